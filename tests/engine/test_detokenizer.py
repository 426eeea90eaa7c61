"""Incremental detokenization: valid UTF-8 only, and stop strings never leak."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from helpers.tiny_models import tiny_tokenizer_json
from kubeinfer.server.engine.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.unit


class HFDecoder:
    """The real byte-level BPE of the tiny test models, behind the engine's decode signature."""

    def __init__(self) -> None:
        self.tok = Tokenizer.from_str(tiny_tokenizer_json())

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def tok() -> HFDecoder:
    return HFDecoder()


def _stream(tok: HFDecoder, text: str, stop: list[str], include: bool = False
            ) -> tuple[list[str], str | None]:
    detok = IncrementalDetokenizer(tok, tok.encode("Hello"), stop, True, include)
    deltas, hit = [], None
    for token in tok.encode(text):
        hit = detok.add_token(token)
        deltas.append(detok.take_delta(finished=hit is not None))
        if hit:
            break
    else:
        deltas.append(detok.take_delta(finished=True))
    return deltas, hit


def test_multibyte_text_streams_as_valid_utf8(tok):
    text = " héllo wörld, 日本語 and 🙂 ok"
    deltas, _ = _stream(tok, text, [])
    assert "".join(deltas) == text
    assert not any("\ufffd" in delta for delta in deltas)
    assert any(delta == "" for delta in deltas)  # some tokens were partial characters


def test_stop_string_is_cut_and_never_leaks(tok):
    deltas, hit = _stream(tok, " The quick brown fox jumps", ["brown f"])
    assert hit == "brown f"
    assert "".join(deltas) == " The quick "
    for i in range(1, len(deltas) + 1):  # no prefix of the stream ever showed "brown"
        assert "brown" not in "".join(deltas[:i])


def test_stop_string_kept_when_asked(tok):
    deltas, hit = _stream(tok, " The quick brown fox jumps", ["brown"], include=True)
    assert hit == "brown" and "".join(deltas) == " The quick brown"


def test_held_back_text_is_flushed_when_no_stop_follows(tok):
    deltas, hit = _stream(tok, " one two thr", ["three"])
    assert hit is None and "".join(deltas) == " one two thr"
    assert "".join(deltas[:-1]) == " one two "  # "thr" was held back until the end
