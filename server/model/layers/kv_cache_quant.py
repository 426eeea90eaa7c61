"""The fp8 KV cache: the storage dtype `--kv-cache-dtype` names, and each layer's per-tensor
K and V scales (vLLM's semantics: the cache holds K / k_scale in fp8, attention reads
fp8 x k_scale).

A layer's scales come from the checkpoint when it carries them (llm-compressor's
`self_attn.k_scale` / `v_scale`, the older `k_proj.output_scale` / `k_proj.k_scale` names, or
one `kv_scale` for both), else from the first K/V the layer stores with
`--calculate-kv-scales`, else 1.0 (e4m3 then holds |x| <= 448 at 3 mantissa bits).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Iterable, Iterator, NamedTuple

import torch

from kubeinfer.kernels.ops import FP8_MAX

log = logging.getLogger(__name__)

KV_CACHE_TORCH_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                         "fp8_e5m2": torch.float8_e5m2}
# --calculate-kv-scales: scale = max |x| / constant, leaving later, larger values headroom below
# e4m3's 448 (vLLM's K_SCALE_CONSTANT / V_SCALE_CONSTANT)
K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0
# checkpoint tensor name -> (the attention module's name, which scale)
_SCALE_NAME = re.compile(r"^(?P<module>.*\.self_attn)\.(?:(?P<kind>k|v|kv)_scale|(?P<proj>k|v)_proj\.(?:output_scale|[kv]_scale))$")


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's storage dtype for a `--kv-cache-dtype` value."""
    return model_dtype if kv_cache_dtype == "auto" else KV_CACHE_TORCH_DTYPES[kv_cache_dtype]


@dataclass
class KVScales:
    """One layer's per-tensor fp8 scales; `calculate`: set them from the first K/V stored, then keep them."""

    k: float = 1.0
    v: float = 1.0
    calculate: bool = False

    def observe(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """--calculate-kv-scales: the scales from this step's K/V (the layer's first store)."""
        self.calculate = False
        self.k = max(float(k.abs().max()) / K_SCALE_CONSTANT, 1e-6) if k.numel() else 1.0
        self.v = max(float(v.abs().max()) / V_SCALE_CONSTANT, 1e-6) if v.numel() else 1.0


def split_kv_scales(weights: Iterable[tuple[str, torch.Tensor]], into: dict[str, KVScales]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream without its KV-cache scales, which go `into` {attention module: scales}."""
    for name, tensor in weights:
        match = _SCALE_NAME.match(name)
        if match is None:
            yield name, tensor
            continue
        if tensor.numel() != 1:
            raise ValueError(f"KV-cache scale {name}: only per-tensor scales are supported "
                             f"(one value), got shape {tuple(tensor.shape)}")
        scales = into.setdefault(match["module"], KVScales())
        kind, value = match["kind"] or match["proj"], float(tensor.float())
        if not value > 0.0:
            raise ValueError(f"KV-cache scale {name} must be positive, got {value}")
        if kind in ("k", "kv"):
            scales.k = value
        if kind in ("v", "kv"):
            scales.v = value


def layer_kv_scales(num_layers: int, cache_dtype: torch.dtype, checkpoint: dict[str, KVScales],
                    calculate: bool) -> list[KVScales | None]:
    """Each decoder layer's scales for a cache of `cache_dtype` (None for all unless it is fp8: a
    cache of the model's dtype ignores the checkpoint's scales, as vLLM's --kv-cache-dtype auto)."""
    if cache_dtype not in FP8_MAX:
        return [None] * num_layers
    by_layer = {int(match[1]): scales for name, scales in checkpoint.items()
                if (match := re.search(r"layers\.(\d+)\.self_attn$", name))}
    log.info("KV cache %s: per-tensor K/V scales of %d of %d layers from the checkpoint, the others %s",
             str(cache_dtype).removeprefix("torch."), len(by_layer), num_layers,
             "from the first K/V each stores (--calculate-kv-scales)" if calculate else "1.0")
    return [KVScales(by_layer[i].k, by_layer[i].v) if i in by_layer else KVScales(calculate=calculate)
            for i in range(num_layers)]


class LayerKVCache(NamedTuple):
    """One decoder layer's paged cache (`kv_cache[0]`, `kv_cache[1]` as the plain pair) and, for an
    fp8 cache, its scales: they belong to the engine's cache, not to the model (engines sharing
    one loaded model may keep different caches)."""

    k: torch.Tensor
    v: torch.Tensor
    scales: KVScales | None = None
