"""A request body's values counted while it streams in, before anything parses it. Chapter 11.

`json.loads` needs the whole body before it can say anything, and a body within the byte limit can still hold a
million one-item lists or a prompt of four million characters: reading, joining and parsing those costs the server
far more than the answer, a 400 that is known after the body's first few kilobytes. `BodyScanner.feed` takes each
chunk as it arrives and counts, outside strings, the arrays and objects and the commas (a value after each), and
under the top-level field "prompt" its strings, its lists and each string's length. Bytes methods and one regular
expression do the counting: the Python work is per string, never per byte, and no object is built. Past a limit,
`feed` raises `TooMany` naming the field, the count so far and the limit; the server answers 400 and drops the rest
of the body unread.

Every count is a lower bound of what the parsed body holds (a string's characters are at least its UTF-8 bytes that
start a character, less six per backslash), so the scanner refuses only bodies the parse would refuse too, and
everything else (types, nesting, numbers, escapes) is still checked after the parse.

    scanner = BodyScanner(max_containers=8384, max_values=33792, max_prompts=128, max_prompt_chars=2816)
    for chunk in chunks:
        scanner.feed(chunk)          # TooMany past a limit
"""
from __future__ import annotations

import re

__all__ = ["BodyScanner", "TooMany"]

_STRING_REST = re.compile(rb'(?:[^"\\]++|\\.)*+', re.S)     # an open string's bytes up to its closing quote
_CONTINUATION = bytes(range(0x80, 0xC0))                    # UTF-8 bytes that continue a character
_KEY_BYTES = 64                                             # a top-level field's name is kept up to this


class TooMany(ValueError):
    """A body past one of the scanner's limits: what ("containers", "values", "prompts" or "prompt_chars"), how many
    were counted so far, the limit, and the top-level field being read (None before the first; for prompt_chars
    the prompt, "the prompt" or "prompt[i]")."""

    def __init__(self, what: str, count: int, limit: int, field: str | None):
        super().__init__(f"{what}: {count} > {limit} in {field!r}")
        self.what, self.count, self.limit, self.field = what, count, limit, field


class BodyScanner:
    """Counts a JSON body's values chunk by chunk (see the module's docstring); `feed` raises TooMany past a limit."""

    def __init__(self, max_containers: int, max_values: int, max_prompts: int, max_prompt_chars: int):
        self.limits = dict(containers=max_containers, values=max_values, prompts=max_prompts,
                           prompt_chars=max_prompt_chars)
        self.containers = self.values = 0    # arrays and objects; commas (both outside strings)
        self._prompt_strings = self._prompt_lists = 0     # under "prompt" (see `prompts`)
        self.field: str | None = None        # the top-level field whose value is being read
        self.depth = 0                       # arrays and objects open around the bytes being read
        self._in_string = self._escaped = False
        self._name = b""                     # the open (or last) string at depth 1, kept up to _KEY_BYTES
        self._named = False                  # that string is closed and may be a field's name (a colon follows)
        self._after_colon = False            # the last byte outside strings that is not blank is a colon
        self._prompt_string = False          # the open string is (part of) the prompt
        self._where = "the prompt"           # which one, as the server's messages name it
        self._chars = 0                      # its characters so far (a lower bound)

    def _check(self, what: str, count: int, field: str | None = None) -> None:
        if count > self.limits[what]:
            raise TooMany(what, count, self.limits[what], field or self.field)

    def feed(self, chunk: bytes) -> None:
        """Counts the next bytes of the body; TooMany as soon as a count passes its limit."""
        pos, end = 0, len(chunk)
        while pos < end:
            if not self._in_string:
                quote = chunk.find(b'"', pos)
                self._outside(chunk, pos, end if quote < 0 else quote)
                if quote < 0:
                    return
                self._open_string()
                pos = quote + 1
            elif self._escaped:                          # a backslash ended the last chunk: skip what it escapes
                self._escaped = False
                self._grow(chunk, pos, pos + 1)
                pos += 1
            else:
                stop = _STRING_REST.match(chunk, pos).end()
                self._grow(chunk, pos, stop)
                if stop == end:
                    return
                if chunk[stop] == 0x5C:                  # a lone backslash at the chunk's end
                    self._grow(chunk, stop, end)
                    self._escaped = True
                    return
                self._in_string = False                  # the closing quote
                self._named = self.depth == 1
                pos = stop + 1

    def _outside(self, chunk: bytes, start: int, stop: int) -> None:
        """Bytes between strings: their brackets and commas counted, the field they belong to followed."""
        if start == stop:
            return
        segment = chunk[start:stop].strip()
        if not segment:
            return
        if self._named and segment[:1] == b":":          # "name": the field whose value follows
            self.field = self._name.decode("utf-8", "replace")
        self._named = False
        self._after_colon = segment[-1:] == b":"
        opened = chunk.count(b"[", start, stop)
        braces = chunk.count(b"{", start, stop)
        self.depth += opened + braces - chunk.count(b"]", start, stop) - chunk.count(b"}", start, stop)
        self.containers += opened + braces
        self.values += chunk.count(b",", start, stop)
        self._check("containers", self.containers)
        self._check("values", self.values + 1)
        if self.field == "prompt" and opened:
            self._prompt_lists += opened
            self._check("prompts", self.prompts)

    @property
    def prompts(self) -> int:
        """Prompts seen so far: strings under "prompt", and lists inside its outer list."""
        return self._prompt_strings + max(self._prompt_lists - 1, 0)

    def _open_string(self) -> None:
        self._in_string, self._chars = True, 0
        if self.depth == 1:
            self._name = b""
        self._prompt_string = self.field == "prompt" and (self.depth >= 2 or (self.depth == 1 and self._after_colon))
        if self._prompt_string:
            self._where = f"prompt[{self._prompt_strings}]" if self.depth >= 2 else "the prompt"
            self._prompt_strings += 1
            self._check("prompts", self.prompts)

    def _grow(self, chunk: bytes, start: int, stop: int) -> None:
        """A piece of the open string: kept if it may name a field, measured if it is the prompt."""
        if self.depth == 1 and len(self._name) < _KEY_BYTES:
            self._name += chunk[start:min(stop, start + _KEY_BYTES - len(self._name))]
        if self._prompt_string:
            piece = chunk[start:stop]
            self._chars += len(piece.translate(None, _CONTINUATION)) - 6 * piece.count(b"\\")
            self._check("prompt_chars", self._chars, self._where)
