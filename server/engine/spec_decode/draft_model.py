"""Draft-model proposer: a smaller model with the same tokenizer guesses k tokens per step.

It runs on the engine's own parts: a second `ModelRunner` (the draft's weights and its own
paged KV cache, on the target's device and dtype), a `KVCacheManager` without prefix cache and
the target's `Sampler` for the draft's distribution q.
Each target sequence has a shadow `Sequence` on the draft side holding the tokens whose K/V the
draft cache has. Per step, for all drafted sequences at once: the shadow drops what the target
rejected (it fed drafts the target may not have kept), catches up on the target's new tokens
and proposes one token, then k - 1 more single-token passes. Greedy requests get the draft's
argmax; sampled ones a sample from the draft's distribution q (the request's temperature,
top-k/p, penalties), with q kept in `Sequence.draft_probs` for the sampler's rejection test.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ..config import EngineConfig
from ..kv_cache_manager import KVCacheManager
from ..scheduler import ScheduledSeq, SchedulerOutput
from ..sequence import Request, Sequence

if TYPE_CHECKING:
    from ...model.loader import LoadedModel
    from .config import SpeculativeConfig
    from .speculator import SpeculationTarget

log = logging.getLogger(__name__)


class DraftVocabularyError(ValueError):
    """The draft model's tokenizer is not the target's: its token ids would mean other text."""


def check_same_vocabulary(target: "LoadedModel", draft: "LoadedModel") -> None:
    target_vocab, draft_vocab = target.tokenizer.backend.get_vocab(), draft.tokenizer.backend.get_vocab()
    if target_vocab != draft_vocab or target.config.vocab_size != draft.config.vocab_size:
        differing = sum(target_vocab.get(token) != draft_vocab.get(token) for token in {*target_vocab, *draft_vocab})
        raise DraftVocabularyError(
            f"the draft model {draft.name!r} does not share the target {target.name!r}'s tokenizer "
            f"({len(draft_vocab)} vs {len(target_vocab)} tokens, {differing} of them with another id or missing; "
            f"vocab_size {draft.config.vocab_size} vs {target.config.vocab_size}): speculative decoding "
            "needs a draft model with the same tokenizer")


class DraftModelProposer:
    def __init__(self, config: "SpeculativeConfig", target: "SpeculationTarget",
                 draft: "LoadedModel | None" = None) -> None:
        """`draft`: an already loaded draft model (tests); else `config.model` is loaded on the
        target's device in the target's dtype."""
        from ..model_runner import ModelRunner, kv_cache_layout

        if draft is None:
            from ...model.loader import load_model

            assert config.model is not None
            draft = load_model(config.model, str(target.loaded.dtype).removeprefix("torch."),
                               str(target.loaded.device.type), target.config.quantization)
        check_same_vocabulary(target.loaded, draft)
        mc, block_size = draft.config, target.config.block_size
        draft_config = EngineConfig(model=config.model or draft.name, block_size=block_size,
                                    enable_prefix_caching=False,
                                    max_num_batched_tokens=max(block_size, target.config.max_num_batched_tokens))
        # room for as many blocks as the target's cache holds, so every running sequence fits
        memory = kv_cache_layout(draft, draft_config).bytes_per_block * target.runner.num_blocks
        self.runner = ModelRunner(draft, replace(draft_config, kv_cache_memory=memory))
        self.kv = KVCacheManager(self.runner.num_blocks, block_size, enable_prefix_caching=False)
        self.sampler = target.sampler   # `distribution` only: stateless, on the same device
        self.generator = torch.Generator(device=draft.device).manual_seed(target.config.seed + 1)
        self.k = config.num_speculative_tokens
        self.max_model_len = target.max_model_len
        # id(target seq) -> (its draft-side sequence, how many leading tokens are the target's)
        self._shadows: dict[int, tuple[Sequence, int]] = {}
        self._seeded: dict[int, torch.Generator] = {}   # id(shadow) -> a seeded request's generator
        log.info("draft model %s: %d layers, KV cache of %d tokens", draft.name, mc.num_hidden_layers,
                 self.runner.num_blocks * block_size)

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        return self.propose_batch([seq], [max_tokens])[0]

    @torch.inference_mode()
    def propose_batch(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        live = [i for i, seq in enumerate(seqs) if self._catch_up(seq, max_tokens[i])]
        for step in range(max(max_tokens, default=0)):
            live = [i for i in live if step < max_tokens[i]]
            if not live:
                break
            shadows = [self._shadows[id(seqs[i])][0] for i in live]
            out = SchedulerOutput()
            for shadow in shadows:
                count = shadow.num_tokens - shadow.num_computed_tokens
                out.scheduled.append(ScheduledSeq(shadow, count, samples=True))
                out.num_tokens += count
            logits, _ = self.runner.run(out)
            assert logits is not None
            tokens, q = self._sample(logits, shadows)
            for row, (i, shadow) in enumerate(zip(live, shadows)):
                shadow.num_computed_tokens = shadow.num_tokens
                shadow.token_ids.append(tokens[row])
                drafts[i].append(tokens[row])
                if q is not None and seqs[i].params.temperature > 0:
                    probs[i].append(q[row])
        for i, seq in enumerate(seqs):
            seq.draft_probs = torch.stack(probs[i]) if probs[i] else None
        return drafts

    def _catch_up(self, seq: Sequence, max_tokens: int) -> bool:
        """Bring `seq`'s shadow to the target's tokens (dropping the K/V of drafts the target
        rejected) with blocks for `max_tokens` more; False if the draft cache is full (then
        the shadow is dropped and this sequence gets no drafts this step)."""
        tokens = seq.token_ids
        entry = self._shadows.get(id(seq))
        if entry is None:
            shadow = Request(f"draft-{id(seq)}", list(tokens), seq.params, frozenset(), self.max_model_len).seqs[0]
            shadow.num_prompt_tokens = seq.num_prompt_tokens   # penalties and min_tokens see outputs as such
            if seq.params.seed is not None:
                self._seeded[id(shadow)] = torch.Generator(device=self.generator.device).manual_seed(
                    seq.params.seed + seq.index)
        else:
            shadow, synced = entry
            known = shadow.token_ids   # the target's first `synced` tokens, then drafts fed last step
            keep = synced
            while keep < min(len(known), len(tokens)) and known[keep] == tokens[keep]:
                keep += 1
            # the last token is fed again when its K/V is there already (drafts the scheduler
            # trimmed, then matched by the target): its logits are what the next draft needs
            self.kv.truncate(shadow, min(keep, shadow.num_computed_tokens, len(tokens) - 1))
            del known[keep:]
            known += tokens[keep:]
        self._shadows[id(seq)] = (shadow, len(tokens))
        if self.kv.allocate_slots(shadow, shadow.num_tokens - shadow.num_computed_tokens + max_tokens):
            return True
        self.release(seq)
        return False

    def _sample(self, logits: torch.Tensor, shadows: list[Sequence]) -> tuple[list[int], torch.Tensor | None]:
        """Greedy rows: the argmax; sampled rows: a sample from the row's distribution q (from
        the request's own generator when it has a seed, so a seeded request replays exactly)."""
        tokens = logits.argmax(dim=-1)
        sampled = [row for row, shadow in enumerate(shadows) if shadow.params.temperature > 0]
        if not sampled:
            return tokens.tolist(), None
        q = self.sampler.distribution(logits, shadows)
        q = q / q.sum(dim=-1, keepdim=True)
        for row in sampled:
            generator = self._seeded.get(id(shadows[row]), self.generator)
            tokens[row] = torch.multinomial(q[row], 1, generator=generator)[0]
        return tokens.tolist(), q

    def release(self, seq: Sequence) -> None:
        entry = self._shadows.pop(id(seq), None)
        if entry is not None:
            self.kv.free(entry[0])
            self._seeded.pop(id(entry[0]), None)
