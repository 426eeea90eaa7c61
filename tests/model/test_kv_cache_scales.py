"""fp8 KV-cache scales from a checkpoint: llm-compressor's `self_attn.k_scale` / `v_scale` and the
older `k_proj.output_scale` / `v_proj.output_scale` names reach their layers; other shapes and
compressed-tensors kv_cache_schemes other than fp8 per-tensor are refused, naming them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.tiny_models import build_tiny_llama
from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.engine.sampling_params import SamplingParams
from kubeinfer.server.model.loader import load_model
from kubeinfer.server.model.quantization.compressed_tensors import _check_kv_cache_scheme

pytestmark = pytest.mark.unit

PROMPT = [list(range(3, 40))]
PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)


def _with_tensors(path, tensors: dict[str, torch.Tensor]):
    file = next(path.glob("*.safetensors"))
    save_file({**load_file(file), **tensors}, file, metadata={"format": "pt"})
    return path


def _layer_scales(llm: LLM) -> list:
    return [cache.scales for cache in llm.engine.runner.kv_caches]


def test_checkpoint_scales_reach_their_layers(tmp_path):
    """Scales computed by --calculate-kv-scales, written into the checkpoint (layer 0 under
    llm-compressor's names, layer 1 under the older output_scale ones), give the same cache and
    so the same logits; a cache of the model's dtype ignores them."""
    path, _ = build_tiny_llama(tmp_path)
    calculated = LLM(loaded_model=load_model(str(path), dtype="float32", device="cpu"), kv_cache_memory=1 << 20,
                     kv_cache_dtype="fp8", calculate_kv_scales=True)
    want = calculated.generate(PROMPT, PARAMS)[0].outputs[0]
    (k0, v0), (k1, v1) = [(s.k, s.v) for s in _layer_scales(calculated)]
    _with_tensors(path, {"model.layers.0.self_attn.k_scale": torch.tensor(k0),
                         "model.layers.0.self_attn.v_scale": torch.tensor(v0),
                         "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([k1]),
                         "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([v1])})
    loaded = load_model(str(path), dtype="float32", device="cpu")
    fp8 = LLM(loaded_model=loaded, kv_cache_memory=1 << 20, kv_cache_dtype="fp8")
    stored = [(k0, v0), (k1, v1)]   # float32 in the checkpoint
    assert [(s.k, s.v) for s in _layer_scales(fp8)] == [pytest.approx(pair, rel=1e-6) for pair in stored]
    assert not any(s.calculate for s in _layer_scales(fp8))
    got = fp8.generate(PROMPT, PARAMS)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert [next(iter(p.values())).logprob for p in got.logprobs] == \
        pytest.approx([next(iter(p.values())).logprob for p in want.logprobs], abs=1e-4)
    plain = LLM(loaded_model=loaded, kv_cache_memory=1 << 20)
    assert _layer_scales(plain) == [None, None]
    first = plain.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0].outputs[0].logprobs[0]
    # a random tiny model's next token is a near tie (top-2 within 0.02): the fp8 choice is among the
    # float32 cache's top 5, its logprob within 0.15
    assert got.token_ids[0] in first and abs(first[got.token_ids[0]].logprob - got.logprobs[0][got.token_ids[0]].logprob) < 0.15


def test_scales_other_than_per_tensor_are_refused(tmp_path):
    path, _ = build_tiny_llama(tmp_path)
    _with_tensors(path, {"model.layers.0.self_attn.k_scale": torch.ones(2)})
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_scale: only per-tensor scales"):
        load_model(str(path), dtype="float32", device="cpu")


def test_compressed_tensors_kv_cache_schemes():
    from compressed_tensors.quantization import QuantizationArgs

    _check_kv_cache_scheme(QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False))
    with pytest.raises(ValueError, match="kv_cache_scheme int 8-bit by tensor is not supported"):
        _check_kv_cache_scheme(QuantizationArgs(num_bits=8, type="int", strategy="tensor", dynamic=False))
    with pytest.raises(ValueError, match="kv_cache_scheme float 8-bit by channel"):
        _check_kv_cache_scheme(QuantizationArgs(num_bits=8, type="float", strategy="channel", dynamic=False))
