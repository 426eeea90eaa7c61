"""GGUF SentencePiece vocabularies ("llama": Llama 2, Gemma, Phi-3) read into a `tokenizers` BPE:
token ids equal SentencePiece's own on text with leading, repeated and trailing spaces, newlines,
digits, accents, CJK and emoji (byte fallback), with and without the dummy space prefix (Gemma has
none), and with a user-defined symbol (after which llama.cpp, unlike SentencePiece, prefixes a space
again); decoding gives the text back.

The SentencePiece models are trained by the test (BPE, byte fallback, identity normalisation, as
Llama's and Gemma's are) and written as GGUF metadata the way llama.cpp's converter does: pieces,
scores, token types (normal 1, unknown 2, control 3, user-defined 4, byte 6), add_space_prefix.
"""

from __future__ import annotations

import pytest

from kubeinfer.server.model.tokenizer.gguf_tokenizer import tokenizer_from_gguf

pytestmark = pytest.mark.integration

spm = pytest.importorskip("sentencepiece")

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Kubernetes schedules pods; the engine batches tokens.",
          "Hello, world! How are you today? I am fine, thank you.", "def main():\n    return [x * 2 for x in range(10)]",
          "Once upon a time there was a tiny model that answered every question with numbers 0123456789."] * 20
TEXTS = ["Hello world", " leading space", "two  spaces and trailing ", "line one\nline two\n\n",
         "numbers 1234567 and 3.14", "café déjà vu", "日本語のテキスト", "emoji 🚀🔥 done", "<turn>user: hi",
         "", " ", "quick brown foxes jumped"]


def _train(tmp_path, prefix: bool):
    model = tmp_path / f"spm-{prefix}"
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_prefix=str(model), vocab_size=420,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   add_dummy_prefix=prefix, user_defined_symbols=["<turn>"], minloglevel=2)
    return spm.SentencePieceProcessor(model_file=f"{model}.model")


def _gguf_metadata(sp, prefix: bool) -> dict:
    """What llama.cpp's converter writes for a SentencePiece tokenizer."""
    def kind(i: int) -> int:
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        return 4 if sp.id_to_piece(i) == "<turn>" else 1

    size = sp.get_piece_size()
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(size)],
            "tokenizer.ggml.scores": [sp.get_score(i) for i in range(size)],
            "tokenizer.ggml.token_type": [kind(i) for i in range(size)],
            "tokenizer.ggml.bos_token_id": sp.bos_id(), "tokenizer.ggml.eos_token_id": sp.eos_id(),
            "tokenizer.ggml.unknown_token_id": sp.unk_id(), "tokenizer.ggml.add_space_prefix": prefix,
            "tokenizer.ggml.add_bos_token": True}


@pytest.mark.parametrize("prefix", [True, False])
def test_token_ids_equal_sentencepiece(tmp_path, prefix):
    sp = _train(tmp_path, prefix)
    tokenizer = tokenizer_from_gguf(_gguf_metadata(sp, prefix))
    for text in TEXTS:
        if prefix and text.startswith("<turn>"):   # llama.cpp: the special piece, then a prefixed " user: hi"
            expected = [sp.piece_to_id("<turn>")] + sp.encode(text.removeprefix("<turn>"))
        else:
            expected = sp.encode(text)
        assert tokenizer.encode(text, add_special_tokens=False).ids == expected, repr(text)
        assert tokenizer.encode(text).ids == [sp.bos_id()] + expected
    assert any(sp.is_byte(i) for i in sp.encode("日本語 🚀"))   # the byte-fallback path was exercised


@pytest.mark.parametrize("prefix", [True, False])
def test_decoding_gives_the_text_back(tmp_path, prefix):
    sp = _train(tmp_path, prefix)
    tokenizer = tokenizer_from_gguf(_gguf_metadata(sp, prefix))
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == sp.decode(ids), repr(text)


def test_the_engine_tokenizer_of_such_a_gguf(tmp_path):
    """Through `gguf_tokenizer` (what the loader uses): BOS added, EOS known, incremental text."""
    from kubeinfer.server.model.checkpoints.tokenizer_files import gguf_tokenizer

    sp = _train(tmp_path, True)
    tokenizer = gguf_tokenizer(_gguf_metadata(sp, True))
    ids = tokenizer.encode("Hello world", add_special_tokens=True)
    assert ids == [sp.bos_id()] + sp.encode("Hello world")
    assert sp.eos_id() in tokenizer.eos_token_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hello world"
