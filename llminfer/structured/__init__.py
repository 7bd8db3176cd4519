"""Structured output: a regex or a JSON Schema compiled to token masks over a real vocabulary. Chapter 13.

regex: pattern -> minimal DFA over UTF-8 bytes; index: the DFA lifted to a tokenizer's tokens (per state, the
allowed token ids); json_schema: JSON Schema -> regex; constraint: one request's state, its mask and jump-forward.
"""
from .constraint import Constraint, ForcedText
from .index import TokenIndex, Vocabulary, compile_index
from .json_schema import UnsupportedSchema, json_object_regex, schema_to_regex
from .regex import DFA, MAX_STATES, compile_regex

__all__ = ["Constraint", "ForcedText", "TokenIndex", "Vocabulary", "compile_index", "UnsupportedSchema",
           "json_object_regex", "schema_to_regex", "DFA", "MAX_STATES", "compile_regex"]
