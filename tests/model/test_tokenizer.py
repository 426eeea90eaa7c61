"""Tokenizer and chat-template parity with transformers, for GGUF-built and HF-directory tokenizers."""

from __future__ import annotations

import json

import pytest
from helpers.tiny_models import make_tiny_llama

from kubeinfer.server.model.checkpoints.gguf_checkpoint import read_gguf_file
from kubeinfer.server.model.checkpoints.hf_checkpoint import read_hf_directory
from kubeinfer.server.model.loader import embedded_model_path
from kubeinfer.server.model.tokenizer.chat_template import ChatTemplateError

pytestmark = pytest.mark.integration

TEXTS = [
    "Hello, world! How are you?",
    "naïve café — Zürich, 東京, Привет, مرحبا",
    "emoji 🚀🔥👍🏽 family 👨‍👩‍👧",
    "  leading and   runs of\tspaces\n\n\nand newlines  ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "code: def f(x):\n    return x**2  # comment",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another, 🌈?"}],
]


@pytest.fixture(scope="module")
def embedded_tokenizers():
    from transformers import AutoTokenizer

    path = embedded_model_path()
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return read_gguf_file(path).tokenizer, reference


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_transformers(embedded_tokenizers, text):
    ours, reference = embedded_tokenizers
    for add_special in (True, False):
        ids = ours.encode(text, add_special_tokens=add_special)
        assert ids == reference.encode(text, add_special_tokens=add_special)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)


def test_gguf_digits_split_like_llama_cpp(embedded_tokenizers):
    """GGUF says pre-tokenizer "smollm": llama.cpp (and SmolLM2's own tokenizer.json) split numbers
    into single digits. transformers ignores that key for this model, so here we differ from it on
    purpose and follow the model's training tokenizer."""
    ours, _ = embedded_tokenizers
    ids = ours.encode("year 2024")
    assert ours.convert_ids_to_tokens(ids)[-4:] == ["2", "0", "2", "4"]
    assert ours.decode(ids) == "year 2024"


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gguf_chat_template_matches_transformers(embedded_tokenizers, messages, add_generation_prompt):
    ours, reference = embedded_tokenizers
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_gguf_special_tokens(embedded_tokenizers):
    ours, reference = embedded_tokenizers
    assert ours.bos_token_id == 1 and ours.eos_token_ids == {2} and ours.vocab_size == 49152
    assert {0, 1, 2} <= ours.all_special_ids
    assert set(reference.all_special_ids) <= ours.all_special_ids
    assert ours.decode(ours.encode("<|im_start|>hi<|im_end|>")) == "hi"


def test_hf_directory_tokenizer_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    path = make_tiny_llama(tmp_path, add_bos_token=True)
    ours, reference = read_hf_directory(path).tokenizer, AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text) and ids[0] == ours.bos_token_id
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    for messages in CONVERSATIONS:
        assert ours.apply_chat_template(messages) == \
            reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_template_rejection_is_a_value_error(tmp_path):
    path = make_tiny_llama(tmp_path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must "
                               "come from the user') }}{% endif %}{{ bos_token }}{{ messages[0]['content'] }}")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = read_hf_directory(path).tokenizer
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x"
    with pytest.raises(ChatTemplateError, match="first message must come from the user") as error:
        tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}])
    assert isinstance(error.value, ValueError)


def test_template_cannot_reach_python_internals(tmp_path):
    path = make_tiny_llama(tmp_path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError):
        read_hf_directory(path).tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def _sentencepiece_tokenizer_dir(tmp_path, kind: str):
    """A HF directory with a SentencePiece-style tokenizer.json trained by `tokenizers`: a Unigram
    model, or a BPE with byte fallback (Gemma's and Llama 2's layout: metaspace, `<0xNN>` bytes)."""
    from tokenizers import SentencePieceBPETokenizer, SentencePieceUnigramTokenizer

    corpus = [text for text in TEXTS if text] * 20
    special = ["<pad>", "<eos>", "<bos>", "<unk>"]
    if kind == "unigram":
        tokenizer = SentencePieceUnigramTokenizer()
        tokenizer.train_from_iterator(corpus, vocab_size=300, special_tokens=special, unk_token="<unk>",
                                      show_progress=False)
    else:
        tokenizer = SentencePieceBPETokenizer(unk_token="<unk>", fuse_unk=True)
        tokenizer.train_from_iterator(corpus, vocab_size=300, special_tokens=special, show_progress=False)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": "<unk>"}))
    return tmp_path


@pytest.mark.parametrize("kind", ["unigram", "bpe-metaspace"])
def test_sentencepiece_tokenizers_match_transformers_and_stream(kind, tmp_path):
    """Gemma-style tokenizers (SentencePiece pieces with a metaspace) through `tokenizers`: the
    same ids and text as transformers, and streamed detokenization equals the whole decode."""
    from transformers import PreTrainedTokenizerFast

    from kubeinfer.server.engine.detokenizer import IncrementalDetokenizer
    from kubeinfer.server.model.checkpoints.tokenizer_files import hf_tokenizer

    path = _sentencepiece_tokenizer_dir(tmp_path, kind)
    ours = hf_tokenizer(path)
    reference = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    assert ours.eos_token_ids == {ours.backend.token_to_id("<eos>")}
    assert json.loads(ours.backend.to_str())["model"]["type"] == ("Unigram" if kind == "unigram" else "BPE")
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
        prompt, output = ids[:3], ids[3:]
        detokenizer = IncrementalDetokenizer(ours, prompt, stop=[])
        streamed = ""
        for token in output:
            detokenizer.add_token(token)
            streamed += detokenizer.take_delta(finished=False)
        streamed += detokenizer.take_delta(finished=True)
        assert streamed == ours.decode(prompt + output)[len(ours.decode(prompt)):]
