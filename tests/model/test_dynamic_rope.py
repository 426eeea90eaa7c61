"""Dynamic NTK rope scaling ("dynamic"): trained on max_position_embeddings, served up to factor
times that (vLLM's limit); a step that takes a sequence past the original context rotates its
tokens with the base transformers recomputes for that length. Compared with transformers step for
step through its cache (it recomputes per forward call, so the same chunks are fed to both):
a 12-token prefill then decode steps that cross 16 positions, and a 30-token prefill that starts
past it; float32, max |logit diff| <= 1e-4."""

from __future__ import annotations

import torch
import pytest

from helpers.paged import PagedRunner, assert_stepwise_parity
from helpers.tiny_models import build_tiny_llama

from kubeinfer.server.model.loader import load_model

pytestmark = pytest.mark.unit

PROMPT = [5, 17, 250, 33, 90, 91, 92, 7, 300, 12, 64, 65, 66, 1, 120, 121, 122, 200, 201, 3, 44, 45]
CONTINUATION = [14, 260, 77, 301, 8, 9, 150, 222, 31, 32]


def _tiny_dynamic_llama(tmp_path):
    return build_tiny_llama(tmp_path, rope_scaling={"rope_type": "dynamic", "factor": 4.0}, max_position_embeddings=16,
                            name="tiny-llama-dynamic")


def test_dynamic_ntk_follows_transformers_past_the_original_context(tmp_path):
    path, hf_model = _tiny_dynamic_llama(tmp_path)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    assert loaded.config.max_position_embeddings == 64
    assert loaded.config.rope_scaling == {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 16}
    for prompt, steps in ((PROMPT[:12], 10), ((PROMPT * 2)[:30], 3)):
        assert_stepwise_parity(loaded.model, hf_model, prompt, CONTINUATION[:steps], atol=1e-4)


def test_sequences_of_a_batch_scale_by_their_own_length(tmp_path):
    """One step with a sequence within the original context and one past it: each row equals
    that sequence's step alone."""
    path, _ = _tiny_dynamic_llama(tmp_path)
    model = load_model(str(path), dtype="float32", device="cpu").model
    short, long = PROMPT[:8], (PROMPT * 2)[:30]
    alone = [PagedRunner(model, num_blocks=32).step([(name, ids)]) for name, ids in (("s", short), ("l", long))]
    together = PagedRunner(model, num_blocks=32).step([("s", short), ("l", long)])
    torch.testing.assert_close(together, torch.cat(alone), atol=1e-5, rtol=0)
