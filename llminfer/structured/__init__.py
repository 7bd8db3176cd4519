"""Structured output: a regex or a JSON Schema compiled to token masks over a real vocabulary. Chapter 13."""
