"""Interactive widgets for the chapters; each submodule builds one, from pure functions that compute what it draws."""
