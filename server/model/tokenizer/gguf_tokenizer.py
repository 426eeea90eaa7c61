"""Build a `tokenizers.Tokenizer` from GGUF metadata (`tokenizer.ggml.*`): byte-level BPE and
SentencePiece BPE vocabularies.

GGUF carries no tokenizer.json, only tokens, merges, token types and llama.cpp's name for the
pre-tokenizer (`tokenizer.ggml.pre`). We rebuild the pipeline llama.cpp applies for that name, so
e.g. SmolLM2 ("smollm") splits digits one by one exactly like its original tokenizer.json.
SentencePiece vocabularies ("llama": Llama 2, Gemma, Phi-3, Mistral v0.1) carry scores instead of
merges; merging the adjacent pair whose union scores highest is BPE with merges ordered by that
score (as transformers converts a SentencePiece model), with spaces as "▁", a leading one (also
after each special token, as llama.cpp) unless `add_space_prefix` is false (Gemma), and `<0xXX>`
byte pieces for what the vocabulary lacks.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Mapping

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4   # llama.cpp token types
SPACE = "\u2581"   # SentencePiece's visible space

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


@functools.lru_cache(maxsize=1)
def _byte_spelling() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (the alphabet byte-level vocabularies are written in)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


@functools.lru_cache(maxsize=1)
def _outside_alphabet() -> re.Pattern[str]:
    """Matches a character that is not a byte spelling (a regex scan: 10x faster than set(token))."""
    return re.compile("[^" + "".join(re.escape(char) for char in _byte_spelling().values()) + "]")


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)   # GPT-2's split
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def tokenizer_from_gguf(meta: Mapping[str, Any]) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        return _sentencepiece_tokenizer(meta)
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer type {kind!r} is not supported (byte-level BPE 'gpt2' and SentencePiece "
                         "'llama' are); load this model from its Hugging Face directory instead")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelling, outside = _byte_spelling(), _outside_alphabet().search
    vocab = {(token if not outside(token) else "".join(spelling[b] for b in token.encode())): index
             for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>…) are matched whole and skipped when decoding; user-defined ones
    # are matched whole but kept. A token spelled outside the byte alphabet (a converter mislabel)
    # is not in `vocab` and would get a new id past the model's vocabulary, so it is left out.
    _add_special_tokens(tokenizer, tokens, types, vocab)
    _add_bos(tokenizer, meta, tokens, default=False)
    return tokenizer


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int], vocab: Mapping[str, int]) -> None:
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == CONTROL and t in vocab])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == USER_DEFINED and t in vocab])


def _add_bos(tokenizer: Tokenizer, meta: Mapping[str, Any], tokens: list[str], default: bool) -> None:
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", default) and bos_id is not None:
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)])


def _sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two normal pieces, the highest-scoring result first
    (transformers' SentencePieceExtractor): BPE then merges in SentencePiece's order."""
    normal = {token: index for index, (token, kind) in enumerate(zip(tokens, types)) if kind == NORMAL}
    merges: list[tuple[float, int, int, str, str]] = []
    for piece, index in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                merges.append((-scores[index], normal[left], normal[right], left, right))
    merges.sort()
    return [(left, right) for _, _, _, left, right in merges]


def _sentencepiece_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    scores: list[float] = meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_sentencepiece_merges(tokens, scores, types),
                                     unk_token=tokens[unk] if unk is not None else None, fuse_unk=True,
                                     byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # llama.cpp prefixes a space to the text and to each piece of it after a special token
    escape = normalizers.Replace(" ", SPACE)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), escape]) if prefix else escape
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    _add_special_tokens(tokenizer, tokens, types, vocab)
    _add_bos(tokenizer, meta, tokens, default=True)   # llama.cpp's default for SentencePiece vocabularies
    return tokenizer
