"""Rotary embedding: the kernel against the reference, the reference and the cache against transformers."""

import pytest
import torch

from kubeinfer.kernels.reference.rope_cache import build_rope_cache, inverse_frequencies
from kubeinfer.kernels.reference.rotary_ref import apply_rotary_ref
from kubeinfer.kernels.triton.rotary import apply_rotary

pytestmark = pytest.mark.integration

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
TOLERANCES = {torch.float32: 1e-5, torch.float16: 1e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,head_dim,rotary_dim", [((8, 2), 64, 64), ((5, 1), 128, 128), ((32, 8), 64, 32)])
def test_kernel_matches_reference(heads, head_dim, rotary_dim, dtype):
    cache = build_rope_cache(rotary_dim, 300, 10000.0, LLAMA3)
    positions = torch.tensor([0, 1, 17, 299, 63, 64])
    q = torch.randn(len(positions), heads[0], head_dim).to(dtype)
    k = torch.randn(len(positions), heads[1], head_dim).to(dtype)
    got_q, got_k = apply_rotary(q, k, positions, cache)
    want_q, want_k = apply_rotary_ref(q, k, positions, cache)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(got_q, want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(got_k, want_k, atol=tol, rtol=tol)


def test_in_place_rotates_the_given_tensors():
    cache = build_rope_cache(64, 16, 500000.0)
    positions = torch.tensor([3, 9])
    q, k = torch.randn(2, 4, 64), torch.randn(2, 2, 64)
    want_q, want_k = apply_rotary_ref(q, k, positions, cache)
    got_q, got_k = apply_rotary(q, k, positions, cache, inplace=True)
    assert got_q is q and got_k is k
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)


def test_rotation_in_a_strided_qkv_view():
    """q and k as views into one fused qkv projection output, as the model produces them."""
    cache = build_rope_cache(64, 32, 10000.0)
    qkv = torch.randn(3, (4 + 2 + 2) * 64)
    q, k = qkv[:, :256].view(3, 4, 64), qkv[:, 256:384].view(3, 2, 64)
    positions = torch.tensor([0, 5, 31])
    want_q, want_k = apply_rotary_ref(q, k, positions, cache)
    apply_rotary(q, k, positions, cache, inplace=True)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3],
                         ids=["default", "linear", "llama3"])
def test_reference_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=512,
                         rope_theta=10000.0, rope_scaling=scaling)
    rope = LlamaRotaryEmbedding(config)
    positions = torch.tensor([0, 7, 100, 511])
    q, k = torch.randn(4, 4, 64), torch.randn(4, 2, 64)
    cos, sin = rope(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = apply_rotary_ref(q, k, positions, build_rope_cache(64, 512, 10000.0, scaling))
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_unknown_scaling_is_rejected():
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        inverse_frequencies(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3],
                         ids=["default", "linear", "llama3"])
def test_table_from_the_models_inverse_frequencies_matches_ours(scaling):
    """The GPU path builds its table from the model's own inv_freq (GGUF rope_freqs included)."""
    from kubeinfer.kernels.reference.rope_cache import cos_sin_table
    from kubeinfer.server.model.layers.rotary import rope_inv_freq

    model_table = cos_sin_table(rope_inv_freq(64, 500000.0, scaling), 256)
    torch.testing.assert_close(model_table, build_rope_cache(64, 256, 500000.0, scaling))
