"""When to draft and how well it went: the engine's side of speculative decoding.

The engine holds one `Speculator` around its proposer. Before a step it drafts for the running
decodes it finds worth it; after the step it hears how many drafts each sequence kept. Two
adaptive rules keep speculation from costing throughput:
- per step: with more running sequences than `disable_by_batch_size`, nobody drafts (the batch
  already fills the forward pass; vLLM's knob of that name);
- per sequence: an exponential moving average of its acceptance rate; below
  `min_acceptance_rate` it stops drafting for `acceptance_retry_steps` steps, doubling the pause
  each time a retry fails again (up to 32x), back to the base pause once a retry does well.
It also keeps vLLM's spec-decode counters (`SpecDecodeStats`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..proposer import Proposer
from ..sequence import Sequence
from ..stats import SpecDecodeStats

if TYPE_CHECKING:
    from ...model.loader import LoadedModel
    from ..config import EngineConfig
    from ..model_runner import ModelRunner
    from ..sampler import Sampler
    from .config import SpeculativeConfig

log = logging.getLogger(__name__)

EMA_WEIGHT = 0.3   # weight of the newest step in a sequence's acceptance average
MAX_BACKOFF = 32


@dataclass
class _Acceptance:
    rate: float = 1.0          # moving average of accepted / drafted tokens
    paused_until: int = 0      # step number before which this sequence does not draft
    backoff: int = 1


class Speculator:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int | None = None,
                 disable_by_batch_size: int | None = None, min_acceptance_rate: float = 0.0,
                 acceptance_retry_steps: int = 16) -> None:
        """`num_speculative_tokens`: most drafts per sequence and step (None: what the proposer
        gives); the other knobs are `SpeculativeConfig`'s (defaults: never adaptive)."""
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.min_acceptance_rate = min_acceptance_rate
        self.retry_steps = acceptance_retry_steps
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * (num_speculative_tokens or 0))
        self._acceptance: dict[int, _Acceptance] = {}   # id(seq) -> its record, until `release`
        self._step = 0
        self._propose_batch = getattr(proposer, "propose_batch", None)
        self._release = getattr(proposer, "release", None)

    def draft(self, running: list[Sequence]) -> None:
        """Set `draft_token_ids` of the running decodes worth drafting for, never past a
        sequence's length limit. A sequence is drafted only if its logits processors are all
        speculative (a grammar's matcher advances through drafts and rolls back), and its
        deterministic drafts are cut to the prefix they allow (a sampled draft model's are
        kept whole: cutting them would bias rejection sampling; a draft the grammar refuses
        is rejected by its masked row anyway)."""
        self._step += 1
        if self.disable_by_batch_size is not None and len(running) > self.disable_by_batch_size:
            return
        seqs, rooms = [], []
        for seq in running:
            room = seq.request.max_total_tokens - seq.num_tokens - 1
            if self.k is not None:
                room = min(room, self.k)
            if room <= 0 or seq.num_tokens - seq.num_computed_tokens != 1 or not all(
                    processor.speculative for processor in seq.logits_processors):
                continue
            record = self._acceptance.get(id(seq))
            if record is not None and record.paused_until > self._step:
                continue
            seqs.append(seq)
            rooms.append(room)
        if not seqs:
            return
        if self._propose_batch is not None:
            drafts = self._propose_batch(seqs, rooms)
        else:
            drafts = [self.proposer.propose(seq, room) for seq, room in zip(seqs, rooms)]
        for seq, room, tokens in zip(seqs, rooms, drafts):
            tokens = list(tokens[:room])
            if tokens and seq.logits_processors and seq.draft_probs is None:
                tokens = _allowed(seq, tokens)
            seq.draft_token_ids = tokens

    def verified(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """`seq` scored `num_drafts` drafts this step and kept the first `num_accepted`."""
        if num_drafts == 0:
            return
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        if len(s.accepted_per_pos) < num_drafts:
            s.accepted_per_pos += [0] * (num_drafts - len(s.accepted_per_pos))
        for position in range(num_accepted):
            s.accepted_per_pos[position] += 1
        if self.min_acceptance_rate <= 0.0:
            return
        record = self._acceptance.setdefault(id(seq), _Acceptance())
        record.rate += EMA_WEIGHT * (num_accepted / num_drafts - record.rate)
        if record.rate < self.min_acceptance_rate:
            record.paused_until = self._step + self.retry_steps * record.backoff
            record.backoff = min(2 * record.backoff, MAX_BACKOFF)
            record.rate = min(1.0, 2 * self.min_acceptance_rate)   # a failed retry pauses again soon
        elif record.rate >= 2 * self.min_acceptance_rate:
            record.backoff = 1

    def release(self, seq: Sequence) -> None:
        """`seq` is finished, aborted or failed: forget it (the proposer too)."""
        self._acceptance.pop(id(seq), None)
        if self._release is not None:
            self._release(seq)


def _allowed(seq: Sequence, tokens: list[int]) -> list[int]:
    """The leading drafts every processor of `seq` allows (none if one raises: it raises again
    when its row is sampled, where the engine fails its request alone)."""
    for processor in seq.logits_processors:
        try:
            tokens = tokens[:processor.validate_drafts(tokens)]
        except Exception:  # noqa: BLE001 - the processor's own row reports it
            log.warning("a logits processor failed to check drafts; not drafting", exc_info=True)
            return []
    return tokens


@dataclass(frozen=True)
class SpeculationTarget:
    """What of the target model a proposer may need: a draft model checks the target's vocabulary,
    loads on its device in its dtype, sizes its cache to the target's (`runner.num_blocks`) and
    samples drafts from the distribution the target's `sampler` would."""

    loaded: "LoadedModel"
    runner: "ModelRunner"
    sampler: "Sampler"
    config: "EngineConfig"
    max_model_len: int


def build_speculator(config: "SpeculativeConfig", target: SpeculationTarget) -> Speculator:
    """The proposer `config.method` names, wrapped in the adaptive policy."""
    proposer: Proposer
    if config.method == "ngram":
        from .ngram import NgramProposer

        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                 config.prompt_lookup_max)
    elif config.method == "suffix":
        from .suffix import SuffixProposer

        proposer = SuffixProposer(config)
    else:
        from .draft_model import DraftModelProposer

        proposer = DraftModelProposer(config, target)
    return Speculator(proposer, config.num_speculative_tokens, config.disable_by_batch_size,
                      config.min_acceptance_rate, config.acceptance_retry_steps)
