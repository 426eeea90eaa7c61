"""Embedding requests through the engine (`--task embed`) against transformers + sentence-level
pooling by hand, on tiny random decoder embedders (float32).

Each test batches prompts of different lengths in one engine, with a step budget smaller than
the longest prompt (so it is pooled over several prefill chunks). Tolerance: cosine >= 0.9999
and max |diff| <= 1e-5 per embedding (normalised vectors; op order differs only).
"""

from __future__ import annotations

import pytest
import torch
from helpers.embedding_models import build_embedding_model, reference_embedding

from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.engine.sampling_params import InvalidRequestError, SamplingParams

pytestmark = pytest.mark.integration

PROMPTS = [[5, 17, 250, 33, 90], list(range(3, 60)), [7] + list(range(100, 140)), [300]]
ATOL = 1e-5


def _engine(path, **kwargs) -> LLM:
    options = dict(dtype="float32", device="cpu", block_size=16, max_num_batched_tokens=32,
                   kv_cache_memory=1 << 20, task="embed")
    return LLM(str(path), **{**options, **kwargs})


def _check(outputs, decoder, pooling: str, normalize: bool, dimensions: int | None = None) -> None:
    for prompt, output in zip(PROMPTS, outputs):
        expected = reference_embedding(decoder, prompt, pooling, normalize, dimensions)
        assert output.finished and output.embedding is not None and output.outputs == []
        assert output.embedding.shape == expected.shape and output.embedding.dtype == torch.float32
        assert torch.nn.functional.cosine_similarity(output.embedding, expected, dim=0) >= 0.9999
        torch.testing.assert_close(output.embedding, expected, atol=ATOL, rtol=0)


def _no_blocks_held(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.kv_cache_usage == 0 and stats.num_running == 0 and not llm.engine.requests


@pytest.mark.parametrize("kind,pooling,normalize", [("qwen3", "last", True), ("mistral", "mean", False),
                                                    ("mistral", "cls", True), ("qwen3", "mean", True)])
def test_sentence_transformers_pooling_matches_transformers(tmp_path, kind, pooling, normalize):
    path, decoder = build_embedding_model(tmp_path, kind=kind, pooling=pooling, normalize=normalize)
    llm = _engine(path)
    assert llm.engine.pooler.config.pooling_type == pooling
    outputs = llm.embed(PROMPTS)
    _check(outputs, decoder, pooling, normalize)
    assert llm.engine.counters.generation_tokens == 0
    assert llm.engine.counters.prompt_tokens == sum(map(len, PROMPTS))
    _no_blocks_held(llm)


def test_prompts_are_batched_in_one_step(tmp_path):
    """Short prompts share one forward pass (prefill only: no decode step follows)."""
    path, decoder = build_embedding_model(tmp_path, kind="qwen3", pooling="last")
    llm = _engine(path, max_num_batched_tokens=64)
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[0][::-1], list(range(200, 230))]
    outputs = llm.embed(prompts)
    assert llm.engine.counters.num_steps == 1 and llm.engine.counters.last_step_seqs == 4
    for prompt, output in zip(prompts, outputs):
        torch.testing.assert_close(output.embedding, reference_embedding(decoder, prompt), atol=ATOL, rtol=0)


def test_bare_decoder_checkpoint_is_an_embedding_model_by_default(tmp_path):
    """e5-mistral's layout: `MistralModel` tensors without the `model.` prefix and no LM head;
    task auto picks embed, and without sentence-transformers files: last token, normalised."""
    path, decoder = build_embedding_model(tmp_path, kind="mistral", pooling=None, bare=True)
    llm = _engine(path, task="auto")
    assert llm.engine.task == "embed"
    _check(llm.embed(PROMPTS), decoder, "last", True)


@pytest.mark.parametrize("pooling_type,pooling", [(3, "last"), (1, "mean")])
def test_gguf_embedding_model_pools_as_its_pooling_type(tmp_path, pooling_type, pooling):
    """A GGUF with llama.cpp's `<arch>.pooling_type` is an embedding model by itself (task auto),
    pooled that way and L2-normalised as llama-server does; reference: transformers' decoder with
    the same Q8_0-rounded weights."""
    from helpers.gguf_export import export_gguf
    from transformers import AutoModelForCausalLM

    path, _ = build_embedding_model(tmp_path, kind="qwen3", pooling=None)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gguf = tmp_path / "embed.Q8_0.gguf"
    rounded = export_gguf(path, lm, gguf, pooling_type=pooling_type)
    llm = _engine(gguf, task="auto")
    assert llm.engine.task == "embed" and llm.engine.pooler.config.pooling_type == pooling
    _check(llm.embed(PROMPTS), rounded.model, pooling, True)


def test_last_token_pooling_reuses_cached_prefixes(tmp_path):
    path, decoder = build_embedding_model(tmp_path, kind="qwen3", pooling="last")
    llm = _engine(path)
    first = llm.embed(PROMPTS)
    again = llm.embed(PROMPTS)
    assert again[1].num_cached_tokens == 48 and again[2].num_cached_tokens == 32
    _check(again, decoder, "last", True)
    for a, b in zip(first, again):
        torch.testing.assert_close(a.embedding, b.embedding, atol=ATOL, rtol=0)
    _no_blocks_held(llm)


def test_mean_pooling_computes_every_token(tmp_path):
    """A cached prefix would leave its tokens out of the mean: such an engine runs without the
    prefix cache, and a repeated prompt pools the same."""
    path, decoder = build_embedding_model(tmp_path, kind="mistral", pooling="mean")
    llm = _engine(path)
    assert llm.engine.kv.cache is None
    llm.embed(PROMPTS)
    again = llm.embed(PROMPTS)
    assert all(output.num_cached_tokens == 0 for output in again)
    _check(again, decoder, "mean", True)


def test_preempted_mean_pooling_starts_over(tmp_path):
    """A sequence preempted half-way through its prompt (its blocks freed) is pooled again from
    its first token: the sum of the chunks before the preemption is dropped."""
    path, decoder = build_embedding_model(tmp_path, kind="mistral", pooling="mean")
    engine = _engine(path).engine
    request = engine.make_pooling_request("a", PROMPTS[1])
    engine.add_request("a", request)
    assert engine.step() == []   # the first 32 of 57 tokens
    seq = request.seqs[0]
    assert seq.num_computed_tokens == 32 and request.pooling.partial is not None
    engine.scheduler.preempt(seq)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert engine.scheduler.num_preemptions == 1 and engine.counters.num_steps == 3
    torch.testing.assert_close(outputs[0].embedding, reference_embedding(decoder, PROMPTS[1], "mean"),
                               atol=ATOL, rtol=0)


def test_matryoshka_dimensions(tmp_path):
    path, decoder = build_embedding_model(tmp_path, kind="qwen3", pooling="last", matryoshka_dimensions=[64, 32, 16])
    llm = _engine(path)
    _check(llm.embed(PROMPTS, dimensions=32), decoder, "last", True, dimensions=32)
    with pytest.raises(InvalidRequestError, match=r"only supports \[64, 32, 16\] matryoshka dimensions") as error:
        llm.embed(PROMPTS, dimensions=20)
    assert error.value.param == "dimensions"


def test_dimensions_need_a_matryoshka_model(tmp_path):
    path, _ = build_embedding_model(tmp_path, kind="qwen3", pooling="last")
    with pytest.raises(InvalidRequestError, match="does not support matryoshka representation"):
        _engine(path).embed(PROMPTS, dimensions=32)


def test_requests_of_the_other_task_are_refused(tmp_path):
    path, _ = build_embedding_model(tmp_path, kind="qwen3", pooling="last")
    embedder = _engine(path)
    with pytest.raises(InvalidRequestError, match="serves embeddings"):
        embedder.generate([PROMPTS[0]], SamplingParams(max_tokens=2))
    generator = _engine(path, task="generate")
    assert generator.engine.pooler is None
    with pytest.raises(InvalidRequestError, match="does not support embeddings"):
        generator.embed(PROMPTS)


def test_too_long_and_empty_inputs(tmp_path):
    path, _ = build_embedding_model(tmp_path, kind="qwen3", pooling="last")
    llm = _engine(path, max_model_len=48)
    with pytest.raises(InvalidRequestError, match="you requested 57 tokens in the input for embedding") as error:
        llm.embed([PROMPTS[1]])
    assert error.value.code == "context_length_exceeded"
    assert len(llm.embed([list(range(3, 51))])[0].embedding) == 64   # exactly the context: fine
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.embed([[]])
    _no_blocks_held(llm)


def test_vllm_runner_spelling(tmp_path):
    """`--runner pooling` is `--task embed` (vLLM >= 0.10 spells it so); a contradiction is refused."""
    from kubeinfer.server.engine.config import EngineConfig

    assert EngineConfig(runner="pooling").task == "embed" and EngineConfig(runner="generate").task == "generate"
    assert EngineConfig(runner="pooling", task="embed").task == "embed"
    with pytest.raises(ValueError, match="--runner pooling conflicts with --task generate"):
        EngineConfig(runner="pooling", task="generate")
    path, decoder = build_embedding_model(tmp_path, kind="qwen3", pooling="last")
    llm = _engine(path, task="auto", runner="pooling")
    assert llm.engine.task == "embed"
    _check(llm.embed(PROMPTS[:1]), decoder, "last", True)


def test_generation_only_features_are_refused_with_embed(tmp_path):
    path, _ = build_embedding_model(tmp_path, kind="qwen3", pooling="last")
    for option in ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, {"enable_lora": True}):
        with pytest.raises(ValueError, match="apply to text generation only"):
            _engine(path, **option)
