"""Streamed JSON pieces add up to json.dumps of the parsed value, however the text was written
and however it was cut into pieces: the promise streamed tool-call arguments rest on."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from kubeinfer.server.api.json_stream import JsonPieces, canonical

pytestmark = pytest.mark.unit

scalars = st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False) | st.text(max_size=12)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=4), max_leaves=20)
formats = st.fixed_dictionaries({"indent": st.none() | st.integers(0, 3),
                                 "separators": st.sampled_from([None, (",", ":"), (" , ", " :  ")]),
                                 "ensure_ascii": st.booleans()})


@settings(max_examples=300, deadline=None)
@given(value=values, fmt=formats, cuts=st.lists(st.integers(1, 9), min_size=1, max_size=60))
def test_pieces_add_up_to_the_canonical_form(value, fmt, cuts) -> None:
    text = json.dumps(value, **fmt)
    expected = json.dumps(value, ensure_ascii=False)
    assert canonical(text) == expected
    pieces, out, position, i = JsonPieces(), [], 0, 0
    while position < len(text):
        step = cuts[i % len(cuts)]
        out += pieces.feed(text[position:position + step])
        position, i = position + step, i + 1
    out += pieces.flush()
    assert "".join(p.text for p in out) == expected


def test_paths_and_complete_scalars() -> None:
    pieces = JsonPieces().feed('{"a": [1, {"b": "xy"}]} {"c": true}')
    scalars = [(p.path, p.value) for p in pieces if p.complete_scalar]
    assert scalars == [((0, "a", 0), 1), ((0, "a", 1, "b"), "xy"), ((1, "c"), True)]
