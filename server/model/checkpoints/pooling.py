"""What an embedding checkpoint says about itself: its task and its sentence-level pooling.

Read from the files sentence-transformers writes next to the weights (`modules.json`,
`1_Pooling/config.json`, a `Normalize` module) as vLLM does, or from a GGUF's `<arch>.pooling_type`
(L2-normalised, as llama-server answers); without them a decoder embedder pools its last token
and L2-normalises (vLLM's default for `--task embed` on a causal model).
`config.json`'s `matryoshka_dimensions` / `is_matryoshka` say which output sizes
(`dimensions`) the model was trained to be truncated to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from ...flags import TASKS

POOLING_TYPES = ("last", "mean", "cls")
# sentence-transformers `pooling_mode` spellings -> ours
_ST_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_ST_MODULES_OK = ("Transformer", "Pooling", "Normalize")
# a checkpoint saved from the bare decoder (`MistralModel`, e5-mistral) names its tensors without
# the causal LM's `model.` prefix
_DECODER_ROOTS = ("embed_tokens", "layers", "norm")


@dataclass(frozen=True)
class PoolerConfig:
    """How one sequence's final hidden states become its embedding."""

    pooling_type: str = "last"       # last | mean | cls
    normalize: bool = True           # L2, after any matryoshka truncation
    matryoshka_dimensions: tuple[int, ...] | None = None   # the sizes allowed; None = any (is_matryoshka)
    is_matryoshka: bool = False
    source: str = "default"          # where it was read from, for the log

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"unsupported pooling type {self.pooling_type!r}; supported: {', '.join(POOLING_TYPES)}")

    @property
    def reuses_prefix_cache(self) -> bool:
        """Only the last token's state is pooled, and a prefix-cache hit never covers it (the
        cache leaves the last token to compute), so cached prefixes give the same embedding.
        Mean and CLS pooling need the hidden states of cached tokens too."""
        return self.pooling_type == "last"

    def check_dimensions(self, dimensions: int | None, hidden_size: int, model_name: str) -> str | None:
        """vLLM's answer to a request's `dimensions` (None: fine)."""
        if dimensions is None:
            return None
        if not self.is_matryoshka:
            return (f'Model "{model_name}" does not support matryoshka representation, changing output '
                    "dimensions will lead to poor results.")
        if dimensions < 1:
            return "Dimensions must be greater than 0"
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            return (f'Model "{model_name}" only supports {list(self.matryoshka_dimensions)} matryoshka '
                    "dimensions, use other output dimensions will lead to poor results.")
        if dimensions > hidden_size:
            return f"dimensions ({dimensions}) must not exceed the model's embedding size ({hidden_size})"
        return None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


# llama.cpp's `<arch>.pooling_type` (an embedding GGUF says how it pools; llama-server L2-normalises)
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}


def _gguf_pooling_type(source: str) -> int | None:
    """A GGUF file's `<arch>.pooling_type`, None for any other source or when it has none."""
    path = Path(source).expanduser()
    if source == "embedded" or not (path.is_file() and path.suffix == ".gguf"):
        return None
    from .gguf_reader import GGUFFile

    meta = GGUFFile(path).metadata
    value = meta.get(f"{meta.get('general.architecture')}.pooling_type")
    return None if value is None else int(value)


def model_directory(source: str) -> Path | None:
    """The HF directory of a model source, None for the embedded model or a GGUF file."""
    if source == "embedded":
        return None
    path = Path(source).expanduser()
    return path if path.is_dir() else None


def resolve_task(task: str, source: str) -> str:
    """`auto` as vLLM's runner auto: a checkpoint of the bare decoder (`architectures` like
    `MistralModel`, `Qwen3Model`: no LM head) serves embeddings, any other generates."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose {', '.join(TASKS)}")
    if task != "auto":
        return task
    if _gguf_pooling_type(source):   # an embedding GGUF (llama.cpp's pooling_type set)
        return "embed"
    directory = model_directory(source)
    if directory is None:
        return "generate"
    architectures = _read_json(directory / "config.json").get("architectures") or []
    bare = bool(architectures) and all(a.endswith("Model") and not a.endswith("ForCausalLM") for a in architectures)
    return "embed" if bare else "generate"


def read_pooler_config(source: str) -> PoolerConfig:
    """The pooling of an embedding checkpoint (sentence-transformers files, a GGUF's pooling_type,
    else the default)."""
    gguf_pooling = _gguf_pooling_type(source)
    if gguf_pooling:
        if gguf_pooling not in _GGUF_POOLING:
            raise ValueError(f"GGUF pooling_type {gguf_pooling} (rank) is not supported; supported: "
                             f"{', '.join(f'{k} ({v})' for k, v in _GGUF_POOLING.items())}")
        return PoolerConfig(pooling_type=_GGUF_POOLING[gguf_pooling], normalize=True, source="GGUF pooling_type")
    directory = model_directory(source)
    if directory is None:
        return PoolerConfig()
    hf_config = _read_json(directory / "config.json")
    dims = hf_config.get("matryoshka_dimensions")
    matryoshka = {"matryoshka_dimensions": tuple(int(d) for d in dims) if dims else None,
                  "is_matryoshka": bool(dims) or bool(hf_config.get("is_matryoshka", False))}
    modules = _read_json(directory / "modules.json") if (directory / "modules.json").is_file() else None
    if modules is None:
        return PoolerConfig(**matryoshka)
    pooling_type, normalize = "last", False
    for module in modules:
        kind = str(module.get("type", "")).rpartition(".")[2]
        if kind not in _ST_MODULES_OK:
            raise ValueError(f"{directory / 'modules.json'}: sentence-transformers module {kind!r} "
                             f"({module.get('path')}) is not supported; supported: {', '.join(_ST_MODULES_OK)}")
        if kind == "Pooling":
            pooling_type = _st_pooling_mode(directory / module.get("path", "1_Pooling") / "config.json")
        normalize = normalize or kind == "Normalize"
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize, source="sentence-transformers", **matryoshka)


def _st_pooling_mode(path: Path) -> str:
    """sentence-transformers' Pooling config: `pooling_mode` (newer) or one `pooling_mode_*` flag."""
    config = _read_json(path)
    if config.get("include_prompt", True) is False:
        raise ValueError(f"{path}: pooling without the prompt (include_prompt false) is not supported")
    mode = config.get("pooling_mode")
    if mode is None:
        flags = {key.removeprefix("pooling_mode_").removesuffix("_tokens").removesuffix("_token")
                 for key, on in config.items() if key.startswith("pooling_mode_") and on}
        if len(flags) != 1:
            raise ValueError(f"{path}: expected exactly one pooling mode, got {sorted(flags) or 'none'}")
        mode = flags.pop()
    if mode not in _ST_MODES:
        raise ValueError(f"{path}: pooling mode {mode!r} is not supported; supported: {', '.join(_ST_MODES)}")
    return _ST_MODES[mode]


def with_causal_lm_names(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Checkpoint names of a bare decoder (`layers.0...`) as the causal LM's (`model.layers.0...`)."""
    for name, tensor in weights:
        yield (f"model.{name}" if name.partition(".")[0] in _DECODER_ROOTS else name), tensor
