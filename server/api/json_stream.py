"""JSON text read as it is generated: canonical pieces, each tagged with where in the value it is.

Streamed tool calls need the arguments of a call while the model is still writing them, and the
pieces sent must add up to exactly what the non-streamed answer holds, which is
`json.dumps(value, ensure_ascii=False)` of the parsed arguments. That serialization is
per-token (", " and ": " between items, each string character escaped on its own, each number
and literal re-serialized alone), so a prefix of the text gives a prefix of it, token by token:
`JsonPieces` re-serializes each token as soon as it is complete, and string values character by
character, whatever whitespace or escapes the model used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

Path = tuple[Any, ...]  # top-level value index, then object keys and array indices
_STRUCTURAL = set('{}[]:,"')
_WHITESPACE = set(" \t\r\n")
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


@dataclass
class Piece:
    """Canonical text of one token (or of string characters) of the value at `path`; `value`
    is set once a scalar (string, number, literal) is complete."""

    path: Path
    text: str
    value: Any = None
    complete_scalar: bool = False


@dataclass
class _Frame:
    kind: str  # "top", "{" or "["
    index: int = 0  # arrays and the top level: the element being read
    key: str | None = None  # objects: the key of the value being read
    expect_key: bool = True  # objects: a key (or the end) comes next


def canonical(text: str) -> str:
    """The whole text as the pieces give it: json.dumps(json.loads(text), ensure_ascii=False) for
    one valid JSON value (tests check it), and a comparable form of a cut-short one."""
    pieces = JsonPieces()
    return "".join(p.text for p in pieces.feed(text) + pieces.flush())


@dataclass
class JsonPieces:
    """A sequence of JSON values (separated by whitespace or ';', as Llama 3.1 writes several
    calls), fed in arbitrary pieces."""

    _stack: list[_Frame] = field(default_factory=lambda: [_Frame("top")])
    _string: list[str] | None = None  # decoded characters of the string being read
    _string_is_key: bool = False
    _escape: str = ""  # an escape sequence not complete yet
    _high_surrogate: str = ""  # a \\uD800-\\uDBFF waiting for its pair
    _bare: str = ""  # a number or literal being read

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        for ch in text:
            self._char(ch, out)
        return _merged(out)

    def flush(self) -> list[Piece]:
        """The end of the text: a number or literal that was still open counts as complete."""
        out: list[Piece] = []
        if self._bare:
            self._end_bare(out)
        return _merged(out)

    def _path(self) -> Path:
        return tuple(f.key if f.kind == "{" else f.index for f in self._stack)

    def _char(self, ch: str, out: list[Piece]) -> None:
        if self._string is not None:
            self._string_char(ch, out)
            return
        if self._bare:
            if ch not in _STRUCTURAL and ch not in _WHITESPACE and ch != ";":
                self._bare += ch
                return
            self._end_bare(out)
        frame = self._stack[-1]
        if ch in _WHITESPACE or (ch == ";" and frame.kind == "top"):
            return
        if ch in "{[":
            out.append(Piece(self._path(), ch))
            self._stack.append(_Frame(ch))
        elif ch in "}]" and frame.kind != "top":
            self._stack.pop()
            out.append(Piece(self._path(), ch))
            self._after_value()
        elif ch == "," and frame.kind != "top":
            out.append(Piece(self._path()[:-1], ", "))
            if frame.kind == "{":
                frame.expect_key, frame.key = True, None
            else:
                frame.index += 1
        elif ch == ":" and frame.kind == "{":
            out.append(Piece(self._path()[:-1], ": "))
        elif ch == '"':
            self._string, self._string_is_key = [], frame.kind == "{" and frame.expect_key
            if not self._string_is_key:
                out.append(Piece(self._path(), '"'))
        else:  # a number or a literal (true, false, null, NaN, Infinity), or text that is not JSON
            self._bare = ch

    def _string_char(self, ch: str, out: list[Piece]) -> None:
        assert self._string is not None
        if self._escape:
            self._escape += ch
            if self._escape[1] == "u":
                if len(self._escape) < 6:
                    return
                try:
                    decoded = chr(int(self._escape[2:], 16))
                except ValueError:
                    decoded = self._escape
            else:
                decoded = _SIMPLE_ESCAPES.get(ch, self._escape)
            self._escape = ""
            self._decoded(decoded, out)
        elif ch == "\\":
            self._escape = ch
        elif ch == '"':
            self._end_string(out)
        else:
            self._decoded(ch, out)

    def _decoded(self, ch: str, out: list[Piece]) -> None:
        """One decoded character; a surrogate pair becomes one character, as json.loads makes it."""
        assert self._string is not None
        if self._high_surrogate:
            high, self._high_surrogate = self._high_surrogate, ""
            if "\udc00" <= ch <= "\udfff":
                ch = chr(0x10000 + ((ord(high) - 0xD800) << 10) + (ord(ch) - 0xDC00))
            else:
                self._emit_chars(high, out)
        if "\ud800" <= ch <= "\udbff":
            self._high_surrogate = ch
            return
        self._emit_chars(ch, out)

    def _emit_chars(self, ch: str, out: list[Piece]) -> None:
        assert self._string is not None
        self._string.append(ch)
        if not self._string_is_key:
            out.append(Piece(self._path(), json.dumps(ch, ensure_ascii=False)[1:-1]))

    def _end_string(self, out: list[Piece]) -> None:
        assert self._string is not None
        if self._high_surrogate:
            pending, self._high_surrogate = self._high_surrogate, ""
            self._emit_chars(pending, out)
        value, self._string = "".join(self._string), None
        frame = self._stack[-1]
        if self._string_is_key:
            frame.key, frame.expect_key = value, False
            out.append(Piece(self._path()[:-1], json.dumps(value, ensure_ascii=False)))
            return
        out.append(Piece(self._path(), '"', value, complete_scalar=True))
        self._after_value()

    def _end_bare(self, out: list[Piece]) -> None:
        token, self._bare = self._bare, ""
        try:
            value = json.loads(token)
            text = json.dumps(value, ensure_ascii=False)
        except ValueError:  # not JSON: passed on as it is
            value, text = token, token
        out.append(Piece(self._path(), text, value, complete_scalar=True))
        self._after_value()

    def _after_value(self) -> None:
        frame = self._stack[-1]
        if frame.kind == "top":
            frame.index += 1


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Neighbouring pieces of one path joined, so a long string is one piece per feed."""
    out: list[Piece] = []
    for piece in pieces:
        if out and out[-1].path == piece.path and not out[-1].complete_scalar and not piece.complete_scalar:
            out[-1] = Piece(piece.path, out[-1].text + piece.text)
        else:
            out.append(piece)
    return out
