"""A JSON Schema turned into a regex whose matches are JSON documents valid against it. Chapter 13.

Layout: one canonical spelling, the one `json.dumps` writes by default: ", " between items, ": " after a key, no
other whitespace, and properties in the schema's order. A fixed layout costs nothing in what can be said and makes
the forced runs long (`{"name": "` is one run), which is what jump-forward feeds on.

Supported: type (string, number, integer, boolean, null, object, array, or a list of them), enum, const,
properties with required and optional keys, additionalProperties false/true (no extra keys are generated either
way), items, minItems, maxItems, minLength, maxLength, pattern (the string must match it whole), anyOf and oneOf
(as alternatives; oneOf's exclusivity is not enforced), $ref to "#/$defs/..." or "#/definitions/..." (not
recursive), and the annotations title, description, default, examples, $schema, $id, strict. Any other keyword
is a ValueError naming it (the server's 400). An object or array without properties or items holds any JSON
value nested up to `max_depth` levels; `json_object_regex` is that for the OpenAI `json_object` mode.
"""
from __future__ import annotations

import json
import re

__all__ = ["schema_to_regex", "json_object_regex", "json_value_regex", "STRING", "NUMBER", "INTEGER",
           "BOOLEAN", "NULL", "UnsupportedSchema"]

CHAR = r'([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'          # one character of a JSON string
STRING = f'"{CHAR}*"'
INTEGER = r"-?(0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(\.[0-9]+)?([eE][+-]?[0-9]+)?"
BOOLEAN = "(true|false)"
NULL = "null"
ITEM_SEP, KEY_SEP = ", ", ": "

ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "strict", "$comment"}
KEYWORDS = {
    "string": {"type", "enum", "const", "minLength", "maxLength", "pattern"},
    "number": {"type", "enum", "const"},
    "integer": {"type", "enum", "const"},
    "boolean": {"type", "enum", "const"},
    "null": {"type", "enum", "const"},
    "object": {"type", "properties", "required", "additionalProperties"},
    "array": {"type", "items", "minItems", "maxItems"},
}
MAX_DEPTH = 2


class UnsupportedSchema(ValueError):
    """A schema keyword (or value) this compiler does not handle; `keyword` names it."""

    def __init__(self, keyword: str, where: str, detail: str = ""):
        self.keyword = keyword
        super().__init__(f"the JSON Schema keyword {keyword!r} at {where} is not supported{detail}; supported are "
                         "type, properties, required, additionalProperties, items, minItems, maxItems, enum, const, "
                         "minLength, maxLength, pattern, anyOf, oneOf and $ref to $defs")


def _literal(value) -> str:
    """A regex matching exactly the JSON text of `value`."""
    return re.escape(json.dumps(value, ensure_ascii=False)).replace("\\ ", " ")


def _repeat(item: str, low: int, high: int | None) -> str:
    """item repeated low..high times (high None: unbounded), separated by ITEM_SEP."""
    if high == 0:
        return ""
    rest_low = max(low - 1, 0)
    rest = f"({ITEM_SEP}{item})" + ("*" if high is None else f"{{{rest_low},{high - 1}}}")
    return f"{item}{rest}" if low >= 1 else f"({item}{rest})?"


def json_value_regex(depth: int = MAX_DEPTH) -> str:
    """Any JSON value, with objects and arrays nested at most `depth` levels."""
    scalar = f"({STRING}|{NUMBER}|{BOOLEAN}|{NULL})"
    if depth <= 0:
        return scalar
    inner = json_value_regex(depth - 1)
    obj = r"\{" + _repeat(f"{STRING}{KEY_SEP}{inner}", 0, None) + r"\}"
    arr = r"\[" + _repeat(inner, 0, None) + r"\]"
    return f"({scalar}|{obj}|{arr})"


def json_object_regex(depth: int = MAX_DEPTH) -> str:
    """The OpenAI json_object mode: one JSON object, values nested at most `depth` - 1 levels below it."""
    return r"\{" + _repeat(f"{STRING}{KEY_SEP}{json_value_regex(depth - 1)}", 0, None) + r"\}"


def schema_to_regex(schema, max_depth: int = MAX_DEPTH) -> str:
    """The regex of the JSON documents valid against `schema` (a dict, or its JSON text), in the canonical layout.
    UnsupportedSchema (a ValueError) names the first keyword it cannot honour."""
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
    return _Compiler(schema, max_depth).node(schema, "#")


class _Compiler:
    def __init__(self, root, max_depth: int):
        self.root, self.max_depth, self.expanding = root, max_depth, []

    def node(self, schema, where: str) -> str:
        if schema is True or schema == {}:
            return json_value_regex(self.max_depth)
        if not isinstance(schema, dict):
            raise ValueError(f"the JSON schema at {where} is {schema!r}; a schema is an object (dict) or true")
        if "$ref" in schema:
            return self.ref(schema, where)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = schema[key]
                if not isinstance(options, list) or not options:
                    raise ValueError(f"{key} at {where} must be a non-empty list of schemas, got {options!r}")
                rest = {k: v for k, v in schema.items() if k != key and k not in ANNOTATIONS}
                if rest:
                    raise UnsupportedSchema(next(iter(rest)), where, f" beside {key}")
                return "(" + "|".join(self.node(o, f"{where}/{key}/{i}") for i, o in enumerate(options)) + ")"
        if "const" in schema:
            self.check_keys(schema, {"const", "type"}, where)
            return _literal(schema["const"])
        if "enum" in schema:
            self.check_keys(schema, {"enum", "type"}, where)
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise ValueError(f"enum at {where} must be a non-empty list of values, got {values!r}")
            return "(" + "|".join(_literal(v) for v in values) + ")"
        kind = schema.get("type")
        if kind is None:
            extra = set(schema) - ANNOTATIONS
            if extra:
                raise UnsupportedSchema(sorted(extra)[0], where, " without a 'type'")
            return json_value_regex(self.max_depth)
        if isinstance(kind, list):
            return "(" + "|".join(self.node({**schema, "type": k}, where) for k in kind) + ")"
        if kind not in KEYWORDS:
            raise ValueError(f"type {kind!r} at {where} is not a JSON Schema type; use one of {', '.join(KEYWORDS)}")
        self.check_keys(schema, KEYWORDS[kind], where)
        return getattr(self, kind)(schema, where)

    def check_keys(self, schema: dict, allowed: set, where: str) -> None:
        for key in schema:
            if key not in allowed and key not in ANNOTATIONS:
                raise UnsupportedSchema(key, where, f" for type {schema.get('type', 'enum/const')!r}")

    def ref(self, schema: dict, where: str) -> str:
        target = schema["$ref"]
        parts = target.split("/") if isinstance(target, str) else []
        if len(parts) != 3 or parts[0] != "#" or parts[1] not in ("$defs", "definitions"):
            raise UnsupportedSchema("$ref", where, f" with the target {target!r} (only '#/$defs/Name')")
        if target in self.expanding:
            raise UnsupportedSchema("$ref", where, f": {target!r} is recursive")
        found = self.root.get(parts[1], {}).get(parts[2]) if isinstance(self.root, dict) else None
        if found is None:
            raise ValueError(f"$ref {target!r} at {where} names no definition in the schema")
        self.expanding.append(target)
        try:
            return self.node(found, target)
        finally:
            self.expanding.pop()

    def string(self, schema: dict, where: str) -> str:
        if "pattern" in schema:
            if "minLength" in schema or "maxLength" in schema:
                raise UnsupportedSchema("pattern", where, " together with minLength/maxLength")
            pattern = schema["pattern"]
            if not isinstance(pattern, str):
                raise ValueError(f"pattern at {where} must be a string, got {pattern!r}")
            return f'"({pattern.removeprefix("^").removesuffix("$")})"'
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        for name, value in (("minLength", low), ("maxLength", high)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name}={value!r} at {where} must be a whole number >= 0")
        if high is not None and high < low:
            raise ValueError(f"maxLength={high} is below minLength={low} at {where}; no string fits")
        if low == 0 and high is None:
            return STRING
        return f'"{CHAR}{{{low},{"" if high is None else high}}}"'

    def number(self, schema: dict, where: str) -> str:
        return NUMBER

    def integer(self, schema: dict, where: str) -> str:
        return INTEGER

    def boolean(self, schema: dict, where: str) -> str:
        return BOOLEAN

    def null(self, schema: dict, where: str) -> str:
        return NULL

    def array(self, schema: dict, where: str) -> str:
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        for name, value in (("minItems", low), ("maxItems", high)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name}={value!r} at {where} must be a whole number >= 0")
        if high is not None and high < low:
            raise ValueError(f"maxItems={high} is below minItems={low} at {where}; no array fits")
        item = self.node(schema.get("items", True), f"{where}/items")
        return r"\[" + _repeat(item, low, high) + r"\]"

    def object(self, schema: dict, where: str) -> str:
        extra = schema.get("additionalProperties", True)
        if extra not in (True, False):
            raise UnsupportedSchema("additionalProperties", where, " as a schema (only true or false)")
        properties = schema.get("properties")
        if properties is None:
            if extra is False:
                return r"\{\}"
            return json_object_regex(self.max_depth)
        if not isinstance(properties, dict):
            raise ValueError(f"properties at {where} must be an object of schemas, got {properties!r}")
        required = schema.get("required", [])
        missing = [name for name in required if name not in properties]
        if missing:
            raise ValueError(f"required names {missing} at {where}, which are not in properties")
        items = [(f"{_literal(name)}{KEY_SEP}{self.node(sub, f'{where}/properties/{name}')}", name in required)
                 for name, sub in properties.items()]
        return r"\{" + _properties(items) + r"\}"


def _properties(items: list[tuple[str, bool]]) -> str:
    """The properties in order, each required one present, each optional one present or not, commas between.
    Whichever property comes first has no comma before it, so the alternatives are: property i is the first
    present (every property before it optional and absent), then each later one with its comma."""
    options = []
    for i, (first, first_required) in enumerate(items):
        rest = "".join(f"{ITEM_SEP}{item}" if required else f"({ITEM_SEP}{item})?" for item, required in items[i + 1:])
        options.append(first + rest)
        if first_required:
            break
    else:
        options.append("")                    # every property optional: the empty object too
    return options[0] if len(options) == 1 else "(" + "|".join(options) + ")"
