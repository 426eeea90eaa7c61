"""Each rank's sharded read equals its slice of the full checkpoint: safetensors via `get_slice`, GGUF
(Q8_0, q/k rows permuted by llama.cpp) dequantizing only its rows and un-permuting its own heads;
a Qwen3-MoE's experts (per-expert safetensors matrices, stacked GGUF `ffn_*_exps`) and a Phi-3's
fused qkv_proj / gate_up_proj (split, then sliced) by the same names and slices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.gguf_export import export_gguf
from helpers.tiny_models import build_tiny_llama, build_tiny_phi3, build_tiny_qwen3_moe
from kubeinfer.server.model.loader import read_checkpoint, uninitialized_modules
from kubeinfer.server.model.registry import model_family
from kubeinfer.server.parallel.model import build_shard, weight_slices
from kubeinfer.server.parallel.plan import ShardPlan
from kubeinfer.server.parallel.weights import sharded_weights

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny_llama_sources(tmp_path_factory) -> dict[str, Path]:
    """A 4-head, 1-KV-head Llama as an HF directory and as a Q8_0 GGUF; a Qwen3-MoE likewise; a Phi-3."""
    tmp = tmp_path_factory.mktemp("tp-weights")
    path, hf_model = build_tiny_llama(tmp, num_kv_heads=1)
    gguf = tmp / "tiny.Q8_0.gguf"
    export_gguf(path, hf_model, gguf)
    moe_path, moe_model = build_tiny_qwen3_moe(tmp)
    export_gguf(moe_path, moe_model, tmp / "tiny-moe.Q8_0.gguf")
    return {"safetensors": path, "gguf": gguf, "qwen3-moe-safetensors": moe_path,
            "qwen3-moe-gguf": tmp / "tiny-moe.Q8_0.gguf", "phi3-fused-safetensors": build_tiny_phi3(tmp)[0]}


def expected_shard(full: torch.Tensor, slices: dict, name: str) -> torch.Tensor:
    part = slices.get(name)
    if part is None:
        return full
    shard = full.narrow(part.dim, part.start, part.stop - part.start)
    if part.dim == 0 and shard.shape[0] < part.padded:
        shard = torch.cat([shard, shard.new_zeros(part.padded - shard.shape[0], *shard.shape[1:])])
    return shard


@pytest.mark.parametrize("source", ["safetensors", "gguf", "qwen3-moe-safetensors", "qwen3-moe-gguf",
                                    "phi3-fused-safetensors"])
@pytest.mark.parametrize("size", [2, 4])
def test_every_rank_reads_exactly_its_slice(tiny_llama_sources, source, size):
    path = tiny_llama_sources[source]
    checkpoint = read_checkpoint(str(path))
    full = dict(checkpoint.weights(torch.float32))
    for rank in range(size):
        plan = ShardPlan(checkpoint.config, rank, size)
        family = model_family(checkpoint.config.architecture)
        with uninitialized_modules(torch.device("cpu"), torch.float32):
            slices = weight_slices(build_shard(family, plan, torch.device("cpu")), plan)
        fused = family.resolve().fused_checkpoint_parts(checkpoint.config)
        shards = dict(sharded_weights(path, plan, slices, family.gguf, torch.float32, fused))
        if "moe" in source:   # every expert's matrices are cut too (gate/up rows, down columns)
            assert {slices[f"model.layers.0.mlp.experts.3.{p}.weight"].dim for p in ("up_proj", "down_proj")} == {0, 1}
        assert shards.keys() == full.keys()
        for name, shard in shards.items():
            torch.testing.assert_close(shard, expected_shard(full[name], slices, name), rtol=0, atol=0,
                                       msg=f"rank {rank}/{size} {source} {name}")
