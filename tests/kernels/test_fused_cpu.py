"""The fused C kernels against their torch references: RMSNorm, SiLU-and-mul and the rotary
embedding (HF's rounding), and the KV-cache store.

bf16: the C kernels round at the same points as the references, so outputs agree exactly
except where float32 sums of squares or exp differ in their last bit and that moves a bf16
rounding: a small fraction of the elements, each by at most two bf16 ulps (one rounding of the
normalised value, carried through the product with the weight).
"""

import pytest
import torch

from kubeinfer.kernels.cpu import fused_cpu
from kubeinfer.kernels.reference.activation_ref import silu_and_mul_ref
from kubeinfer.kernels.reference.kv_cache_ref import store_kv_cache_ref
from kubeinfer.kernels.reference.rms_norm_ref import rms_norm_ref
from kubeinfer.kernels.reference.rotary_ref import rotate_signed_ref

# every build variant: AMX, AVX-512 without AMX, AVX2
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("cpu_isa")]


def _random(*shape, dtype, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _assert_close_to_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    differ = got != want
    assert differ.float().mean() < 0.01, f"{int(differ.sum())} of {got.numel()} elements differ"
    two_ulps = want.float().abs().clamp(min=1e-30) * 2 ** -6   # bf16 keeps 8 significant bits
    assert ((got.float() - want.float()).abs() <= two_ulps).all()


def test_available_for_cpu_float32_and_bfloat16_only():
    assert fused_cpu.available(torch.zeros(1)) and fused_cpu.available(torch.zeros(1, dtype=torch.bfloat16))
    assert not fused_cpu.available(torch.zeros(1, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (37, 576), (64, 4096), (3, 7)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, rows, hidden, with_residual):
    x = _random(rows, hidden, dtype=dtype, seed=1, scale=3.0)
    weight = _random(hidden, dtype=dtype, seed=2)
    residual = _random(rows, hidden, dtype=dtype, seed=3) if with_residual else None
    x_before = x.clone()
    got = fused_cpu.rms_norm(x, weight, 1e-5, residual)
    want = rms_norm_ref(x, weight, 1e-5, residual)
    assert torch.equal(x, x_before)   # inputs untouched
    if with_residual:
        assert torch.equal(got[1], want[1])   # the rounded sum is exact
        got, want = got[0], want[0]
    _assert_close_to_rounding(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 1536), (33, 1536), (2, 5), (3, 37)])
def test_silu_and_mul_matches_reference(dtype, rows, inter):
    x = _random(rows, 2 * inter, dtype=dtype, seed=4, scale=4.0)
    _assert_close_to_rounding(fused_cpu.silu_and_mul(x), silu_and_mul_ref(x))


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)])
def test_silu_extremes(dtype, rtol):
    """Far tails (e^-x clamped at e^-87), both signs of zero's neighbourhood, a partial vector."""
    gate = [-100.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 100.0, -3.0, 3.0]
    x = torch.tensor([gate + [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0]], dtype=dtype)
    torch.testing.assert_close(fused_cpu.silu_and_mul(x), silu_and_mul_ref(x), atol=1e-6, rtol=rtol)


def test_strided_input_is_accepted():
    x = _random(8, 1200, dtype=torch.bfloat16, seed=5)[:, 100:1124]
    _assert_close_to_rounding(fused_cpu.silu_and_mul(x), silu_and_mul_ref(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 12, 64), (40, 12, 64), (300, 40, 128), (3, 2, 6)])
def test_rotary_in_place_matches_reference(dtype, tokens, heads, head_dim):
    """Rotates q and k heads inside the fused qkv rows (a strided view), leaving v alone; bf16 is
    bit-identical (every product rounded), float32 within one rounding (the compiler may fuse a
    product and the sum into one FMA)."""
    qkv = _random(tokens, (heads + 3) * head_dim, dtype=dtype, seed=5, scale=2.0)
    cos = _random(tokens, 1, head_dim, dtype=dtype, seed=6).clamp(-1, 1)
    sin = _random(tokens, 1, head_dim, dtype=dtype, seed=7).clamp(-1, 1)
    before = qkv.clone()
    qk = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    want = rotate_signed_ref(qk.clone(), cos, sin)
    got = fused_cpu.rotate_in_place(qk, cos, sin)
    assert got.data_ptr() == qkv.data_ptr()
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, heads * head_dim:], before[:, heads * head_dim:])


def test_rotary_refuses_heads_that_are_not_rows():
    x = torch.zeros(4, 64, 3, dtype=torch.bfloat16).transpose(1, 2)
    with pytest.raises(ValueError, match="contiguous heads"):
        fused_cpu.rotate_in_place(x, torch.zeros(4, 1, 3), torch.zeros(4, 1, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_reference_and_skips_negative_slots(dtype):
    tokens, kv_heads, head_dim, blocks, block_size = 37, 3, 64, 9, 16
    qkv = _random(tokens, (6 + 2 * kv_heads) * head_dim, dtype=dtype, seed=8)
    k = qkv[:, 6 * head_dim:(6 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (6 + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(9))[:tokens]
    slots[::5] = -1
    caches = [_random(blocks, block_size, kv_heads, head_dim, dtype=dtype, seed=s) for s in (10, 11)]
    want = [c.clone() for c in caches]
    fused_cpu.store_kv(k, v, *caches, slots)
    store_kv_cache_ref(k, v, *want, slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])


def _bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Bit j % 32 of word j // 32 set: token j allowed (xgrammar's layout)."""
    vocab = logits.shape[1]
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.flatten(1)[:, :vocab].bool()
    out = logits.clone()
    alive = []
    for row in rows:
        out[row] = out[row].masked_fill(~allowed[row], float("-inf"))
        alive.append(bool((out[row][allowed[row]] > float("-inf")).any()))
    return out, torch.tensor(alive, dtype=torch.bool)


@pytest.mark.parametrize("vocab", [49152, 49157, 31, 64])
def test_token_bitmask_matches_reference(vocab):
    """Masks the listed rows only, whatever mix of all-clear, all-set and mixed words they
    have, a vocabulary that ends inside a word included; the other rows keep their logits."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (6, words), dtype=torch.int32, generator=gen)
    bitmask[0] = 0                        # nothing allowed
    bitmask[1] = -1                       # everything allowed
    bitmask[2, words // 2:] = 0           # a sparse row, as inside JSON punctuation
    bitmask[3, ::3] = -1
    bitmask[4] = 0
    last = (vocab - 1) % 32
    bitmask[4, -1] = 1 << last if last < 31 else -(1 << 31)   # only the last token (bit 31: the sign)
    rows = [0, 1, 2, 4, 5]
    want, want_alive = _bitmask_ref(logits, bitmask, rows)
    alive = fused_cpu.apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, want)
    assert alive.tolist() == want_alive.tolist()
    assert want_alive.tolist()[:2] == [False, True] and want_alive[3]   # nothing, everything, the last token


def test_token_bitmask_alive_only_where_an_allowed_logit_is_finite():
    """-inf already in the allowed places (min_tokens masked the only way out) or NaN: not alive."""
    logits = torch.zeros(3, 64)
    bitmask = torch.zeros(3, 2, dtype=torch.int32)
    bitmask[:, 0] = 0b101
    logits[0, [0, 2]] = float("-inf")
    logits[1, 0], logits[1, 2] = float("-inf"), float("nan")
    logits[2, 0] = float("-inf")
    alive = fused_cpu.apply_token_bitmask(logits, bitmask, [0, 1, 2])
    assert alive.tolist() == [False, False, True]
    assert torch.isinf(logits[:, 3:]).all() and logits[2, 2] == 0


def test_token_bitmask_refuses_what_it_cannot_read():
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError):
        fused_cpu.apply_token_bitmask(logits, torch.zeros(2, 1, dtype=torch.int32), [0])   # covers 32 of 64
    with pytest.raises(ValueError):
        fused_cpu.apply_token_bitmask(logits, torch.zeros(2, 2, dtype=torch.int32), [2])
    with pytest.raises(ValueError):
        fused_cpu.apply_token_bitmask(logits.to(torch.bfloat16), torch.zeros(2, 2, dtype=torch.int32), [0])


def _inverse_transform_ref(logits: torch.Tensor, temperature: float, uniform: float) -> tuple[int, torch.Tensor]:
    """The Sampler's torch rule for one row, and the row's cumulative probabilities."""
    cumulative = (logits.double() / temperature).softmax(-1).cumsum(-1)
    return int(torch.searchsorted(cumulative, torch.tensor([uniform * float(cumulative[-1])],
                                                            dtype=torch.float64), right=True)), cumulative


@pytest.mark.parametrize("vocab", [49152, 49157, 37, 64])
def test_sample_rows_draws_the_token_of_the_inverse_transform(vocab, two_threads):
    """For rows of random logits at several temperatures and uniforms across [0, 1), listed out
    of order in a wider (strided) tensor: the kernel draws the token whose cumulative
    probability interval holds the uniform number, up to float rounding at an interval's edge
    (rows split over two threads at the large vocabularies)."""
    gen = torch.Generator().manual_seed(vocab)
    wide = torch.randn(6, vocab + 5, generator=gen) * 4
    logits = wide[:, :vocab]
    rows = [5, 0, 3, 3, 1, 4, 2]
    temperatures = [0.5, 1.0, 1.7, 0.05, 1.0, 3.0, 1.0]
    uniform = torch.tensor([0.0, 0.999999, 0.25, 0.5, 0.7, 0.01, 0.9])
    drawn = fused_cpu.sample_rows(logits, rows, temperatures, uniform)
    for token, row, temperature, u in zip(drawn.tolist(), rows, temperatures, uniform.tolist()):
        want, cumulative = _inverse_transform_ref(logits[row], temperature, u)
        if token != want:   # only where u sits on the edge between the two tokens' intervals
            edge = float(cumulative[min(token, want)])
            assert abs(edge - u) < 1e-5, (row, token, want, edge, u)


def test_sample_rows_follows_the_softmax_over_many_draws():
    """10,000 draws of one row: each token's frequency is its softmax probability at T=0.8."""
    logits = torch.tensor([[2.0, 0.5, -1.0, 1.0, float("-inf"), 0.0]])
    draws = 10_000
    uniform = torch.rand(draws, generator=torch.Generator().manual_seed(1))
    tokens = fused_cpu.sample_rows(logits, [0] * draws, [0.8] * draws, uniform)
    frequency = torch.bincount(tokens, minlength=6).double() / draws
    expected = (logits[0].double() / 0.8).softmax(-1)
    assert frequency[4] == 0
    assert (frequency - expected).abs().max() < 0.015   # 3 standard deviations of a frequency over 10,000 draws


def test_sample_rows_never_draws_a_masked_token():
    """Masked (-inf) tokens before, between and after the allowed ones, at both ends of the
    uniform range and across a 64-token block edge: never drawn."""
    logits = torch.full((1, 200), float("-inf"))
    logits[0, [1, 63, 64, 150]] = torch.tensor([0.0, 1.0, -0.5, 2.0])
    uniform = torch.tensor([0.0, 1.0 - 2 ** -24, 0.05, 0.3, 0.5])
    drawn = fused_cpu.sample_rows(logits, [0] * 5, [1.0] * 5, uniform).tolist()
    assert set(drawn) <= {1, 63, 64, 150} and drawn[0] == 1 and drawn[1] == 150


def test_sample_rows_gives_vocab_for_rows_it_cannot_sample():
    """All -inf (every token masked), a NaN, or +inf (inf - inf): `vocab`, the caller's row error."""
    logits = torch.zeros(4, 100)
    logits[0] = float("-inf")
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    drawn = fused_cpu.sample_rows(logits, [0, 1, 2, 3], [1.0] * 4, torch.full((4,), 0.5))
    assert drawn.tolist()[:3] == [100, 100, 100] and 0 <= drawn[3] < 100


def test_sample_rows_refuses_what_it_cannot_read():
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError):
        fused_cpu.sample_rows(logits.to(torch.bfloat16), [0], [1.0], torch.zeros(1))
    with pytest.raises(ValueError):
        fused_cpu.sample_rows(logits, [2], [1.0], torch.zeros(1))
    with pytest.raises(ValueError):
        fused_cpu.sample_rows(logits, [0], [0.0], torch.zeros(1))   # greedy rows take argmax
    with pytest.raises(ValueError):
        fused_cpu.sample_rows(logits, [0, 1], [1.0], torch.zeros(2))
