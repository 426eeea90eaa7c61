"""GGUF for Gemma 2, Gemma 3 and Phi-3 as llama.cpp's converter writes them (`helpers.gguf_export`):
Gemma's norms stored as 1 + w, its sandwich norms under llama.cpp's names, soft-caps, window and
global-layer pattern in the metadata, the attention scale and local rope base completed as llama.cpp
completes them; Phi-3's stacked attn_qkv / ffn_up split at load. Each loads to the logits of the
transformers model holding the same Q8_0-rounded weights: prefill in two chunks over the paged
cache, then 8 decode steps, fp32, max |diff| <= 1e-4 (as tests/model/test_family_parity.py).
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.gguf_export import export_gguf
from helpers.paged import PagedRunner
from helpers.tiny_models import BOS_ID, EOS_ID, VOCAB_SIZE, _DIMS, _build, build_tiny_gemma3, build_tiny_phi3

from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.engine.sampling_params import SamplingParams
from kubeinfer.server.model.checkpoints.gguf_checkpoint import read_gguf_file
from kubeinfer.server.model.loader import load_model

pytestmark = pytest.mark.integration

FP32_ATOL = 1e-4
PROMPT = [5, 17, 250, 33, 90, 91, 92, 7, 300, 12, 64, 65, 66, 1, 120, 121, 122, 200, 201, 3, 44, 45]
CONTINUATION = [14, 260, 77, 301, 8, 9, 150, 222]


def build_gemma2_for_gguf(tmp_path):
    """Tiny Gemma 2 (local + global layer, window 8, both soft-caps) with query_pre_attn_scalar =
    head_dim, which is what llama.cpp assumes for every Gemma 2 but the 27B (GGUF has no key for it)."""
    from transformers import Gemma2Config

    config = Gemma2Config(vocab_size=VOCAB_SIZE, num_key_value_heads=2, head_dim=16, sliding_window=8,
                          layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
                          attn_logit_softcapping=1.0, final_logit_softcapping=3.0,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
                          bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=0, **_DIMS)
    return _build(tmp_path, config, 0, False, None, "tiny-gemma2-gguf")


FAMILIES = {"gemma2": build_gemma2_for_gguf, "gemma3_text": build_tiny_gemma3,
            "phi3": functools.partial(build_tiny_phi3, sliding_window=8)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def exported(request, tmp_path_factory):
    """(family, GGUF path, transformers model with the Q8_0 round-trip applied)."""
    tmp = tmp_path_factory.mktemp(request.param)
    path, hf_model = FAMILIES[request.param](tmp)
    gguf = tmp / f"tiny-{request.param}.Q8_0.gguf"
    return request.param, gguf, export_gguf(path, hf_model, gguf)


def test_config_from_gguf_metadata(exported):
    name, gguf, hf_model = exported
    config = load_model(str(gguf), dtype="float32", device="cpu").config
    hf = hf_model.config
    assert config.architecture == name and config.sliding_window == 8
    if name == "phi3":
        assert not config.tie_word_embeddings and config.layer_types == () and config.hidden_act == "silu"
        return
    assert config.hidden_act == "gelu_pytorch_tanh" and config.tie_word_embeddings
    assert config.query_pre_attn_scalar == hf.query_pre_attn_scalar
    assert list(config.layer_types) == list(hf.layer_types)
    assert config.attn_logit_softcapping == hf.attn_logit_softcapping
    assert config.final_logit_softcapping == hf.final_logit_softcapping
    if name == "gemma3_text":
        assert config.rope_local_theta == 10000.0 and config.rope_theta == 1e6
        assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_gguf_logits_match_transformers(exported):
    _, gguf, hf_model = exported
    loaded = load_model(str(gguf), dtype="float32", device="cpu")
    sequence = PROMPT + CONTINUATION
    with torch.no_grad():
        reference = hf_model(torch.tensor([sequence])).logits[0].float()
    runner = PagedRunner(loaded.model, num_blocks=32)
    steps = [runner.step([("a", PROMPT[:9])], all_logits=True), runner.step([("a", PROMPT[9:])], all_logits=True)]
    steps += [runner.step([("a", [token])]) for token in sequence[len(PROMPT):-1]]
    torch.testing.assert_close(torch.cat(steps), reference[:-1], atol=FP32_ATOL, rtol=0)


def test_gguf_serves_greedy_tokens_like_transformers(exported):
    _, gguf, hf_model = exported
    llm = LLM(str(gguf), dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16,
              kv_cache_memory=4 << 20)
    output = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    ids = PROMPT + output.outputs[0].token_ids
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, len(PROMPT) - 1:-1].float()
    chosen = torch.tensor(output.outputs[0].token_ids)
    gaps = logits.max(-1).values - logits.gather(1, chosen[:, None])[:, 0]
    assert float(gaps.max()) < 1e-3   # every token transformers' argmax (or a near-tie)


def test_phi3_stacked_matrices_keep_their_quantized_rows(tmp_path):
    """The raw Q8_0 blocks of attn_qkv / ffn_up are split by rows like their values, so the
    quantized-linear kernel finds q/k/v and gate/up under their own names."""
    path, hf_model = build_tiny_phi3(tmp_path, sliding_window=8)
    gguf = tmp_path / "phi3.gguf"
    export_gguf(path, hf_model, gguf)
    checkpoint = read_gguf_file(gguf)
    weights = dict(checkpoint.weights(torch.float32))
    rows = {"q_proj": 64, "k_proj": 32, "v_proj": 32}
    for projection, count in rows.items():
        name = f"model.layers.0.self_attn.{projection}.weight"
        qtype, blocks = checkpoint.quantized[name]
        assert qtype == "Q8_0" and blocks.shape[0] == count == weights[name].shape[0]
    assert checkpoint.quantized["model.layers.1.mlp.up_proj.weight"][1].shape[0] == 128
    assert "model.layers.0.self_attn.qkv_proj.weight" not in weights


def test_phi3_longrope_gguf_is_refused_naming_it(tmp_path):
    from kubeinfer.server.model.config import ModelConfig

    meta = {"general.architecture": "phi3", "phi3.embedding_length": 64, "phi3.attention.head_count": 4,
            "phi3.block_count": 2, "phi3.feed_forward_length": 128, "tokenizer.ggml.tokens": ["a"] * 8}
    with pytest.raises(ValueError, match="LongRoPE factors"):
        ModelConfig.from_gguf(meta, {"rope_factors_long.weight", "rope_factors_short.weight"})


@pytest.mark.parametrize("name", ["phi3", "gemma2"])
def test_tensor_parallel_ranks_read_their_slices(name, tmp_path):
    """TP=2: each rank's GGUF stream (Phi-3's stacked matrices split then sliced, Gemma's norms
    shifted) equals its slice of the single-device stream."""
    from kubeinfer.server.model.loader import read_checkpoint, uninitialized_modules
    from kubeinfer.server.model.registry import model_family
    from kubeinfer.server.parallel.model import build_shard, weight_slices
    from kubeinfer.server.parallel.plan import ShardPlan
    from kubeinfer.server.parallel.weights import sharded_weights

    path, hf_model = FAMILIES[name](tmp_path)
    gguf = tmp_path / f"{name}.gguf"
    export_gguf(path, hf_model, gguf)
    checkpoint = read_checkpoint(str(gguf))
    full = dict(checkpoint.weights(torch.float32))
    family = model_family(checkpoint.config.architecture)
    for rank in range(2):
        plan = ShardPlan(checkpoint.config, rank, 2)
        with uninitialized_modules(torch.device("cpu"), torch.float32):
            slices = weight_slices(build_shard(family, plan, torch.device("cpu")), plan)
        fused = family.resolve().fused_checkpoint_parts(checkpoint.config)
        shards = dict(sharded_weights(gguf, plan, slices, family.gguf, torch.float32, fused))
        assert shards.keys() == full.keys()
        for tensor_name, tensor in full.items():
            part = slices.get(tensor_name)
            expected = tensor if part is None else part.pad(tensor.narrow(part.dim, part.start, part.stop - part.start))
            torch.testing.assert_close(shards[tensor_name], expected, atol=0, rtol=0)
