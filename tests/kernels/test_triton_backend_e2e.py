"""A tiny Llama decoding through `TritonAttention` (interpreted) yields the torch path's tokens.

Two sequences share every step: a full prefill next to a first prompt chunk, then a decode
next to the prompt's second chunk (prefill over a cached prefix), then decodes only.
"""

import random

import torch
from helpers.tiny_models import make_tiny_llama

from kubeinfer.server.model.attention import TorchAttention
from kubeinfer.server.model.attention_triton import TritonAttention
from kubeinfer.server.model.forward_batch import ForwardBatch
from kubeinfer.server.model.loader import load_model

BLOCK_SIZE, NUM_BLOCKS = 16, 12


def _forward_batch(steps: list[tuple[list[int], int, list[int]]]) -> ForwardBatch:
    """One step: per sequence (all its tokens, how many are new this step, its blocks)."""
    ids, positions, slots, query_lens = [], [], [], []
    for tokens, new, blocks in steps:
        for pos in range(len(tokens) - new, len(tokens)):
            ids.append(tokens[pos])
            positions.append(pos)
            slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        query_lens.append(new)
    seq_lens = [len(tokens) for tokens, _, _ in steps]
    tables = torch.zeros(len(steps), max(len(blocks) for _, _, blocks in steps), dtype=torch.int32)
    for i, (_, _, blocks) in enumerate(steps):
        tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    starts = torch.tensor([0, *query_lens]).cumsum(0)
    return ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
        block_tables=tables, query_start_loc=starts.to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), logits_indices=starts[1:] - 1,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens)


def _greedy(model, config, schedule: list[list[int]], prompts: list[list[int]]):
    """Feed each sequence `schedule[step][i]` pending tokens per step, prompt first, then its own
    greedy samples; returns the sampled tokens and every step's logits."""
    shape = (NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    kv_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]
    pool = random.Random(0).sample(range(NUM_BLOCKS), NUM_BLOCKS)   # unordered block ids
    blocks = [[pool.pop(), pool.pop()] for _ in prompts]
    pending, tokens = [list(p) for p in prompts], [[] for _ in prompts]
    generated, all_logits = [[] for _ in prompts], []
    for step in schedule:
        for i, new in enumerate(step):
            tokens[i] += pending[i][:new]
            del pending[i][:new]
        with torch.no_grad():
            logits = model(_forward_batch([(tokens[i], new, blocks[i]) for i, new in enumerate(step)]), kv_caches)
        all_logits.append(logits)
        for i in range(len(step)):
            if not pending[i]:   # prompt fully fed: this step's last row samples the next token
                generated[i].append(int(logits[i].argmax()))
                pending[i].append(generated[i][-1])
    return generated, all_logits


def test_tiny_llama_decodes_the_same_tokens_through_triton_attention(tmp_path):
    path = str(make_tiny_llama(tmp_path))
    torch_model = load_model(path, dtype="float32", device="cpu")
    triton_model = load_model(path, dtype="float32", device="cpu")
    for layer in triton_model.model.model.layers:
        layer.self_attn.backend = TritonAttention()
    assert isinstance(torch_model.model.model.layers[0].self_attn.backend, TorchAttention)
    prompts = [list(range(10, 17)), list(range(40, 53))]        # 7 and 13 prompt tokens
    schedule = [[7, 6], [1, 7], [1, 1], [1, 1], [1, 1]]       # prefill | chunk, decode | chunk, decodes
    want_tokens, want_logits = _greedy(torch_model.model, torch_model.config, schedule, prompts)
    got_tokens, got_logits = _greedy(triton_model.model, triton_model.config, schedule, prompts)
    assert got_tokens == want_tokens and [len(t) for t in got_tokens] == [5, 4]
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
