"""What a speculative step costs: the step time of B decoding sequences with no drafts against
k drafts each (all scored, whatever they are), the embedded model on this machine. The ratio
minus one is how many drafts a sequence must keep per step for speculation to pay, which is
what `disable_by_batch_size` is chosen from (BENCHMARKS.md, "Speculative decoding").

    OMP_NUM_THREADS=1 python benchmarks/spec_step_cost.py [k]      # default 6
"""

from __future__ import annotations

import statistics
import sys
import time

from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.engine.sampling_params import SamplingParams
from kubeinfer.server.engine.sequence import Sequence
from kubeinfer.server.engine.spec_decode.speculator import Speculator
from kubeinfer.server.model.loader import load_model

BATCHES = (1, 4, 8, 16, 32)


class FixedDrafts:
    """k drafts of one token for every sequence: they are scored, rarely kept."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        return [100] * min(self.k, max_tokens)


def median_step(loaded, batch: int, k: int) -> float:
    llm = LLM(loaded_model=loaded, kv_cache_memory=512 << 20, max_num_seqs=64,
              speculator=Speculator(FixedDrafts(k)) if k else None)
    for i in range(batch):   # 128-token prompts, then 12 decode steps
        llm.engine.add_request(str(i), list(range(1000 + i, 1128 + i)),
                               SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    times = []
    while llm.engine.has_unfinished_requests():
        start = time.perf_counter()
        llm.engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[-8:])


def main() -> None:
    k = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    loaded = load_model("embedded", dtype="auto", device="cpu")
    best: dict[tuple[int, int], float] = {}
    for _ in range(2):   # best of two, interleaved
        for batch in BATCHES:
            for drafts in (0, k):
                seconds = median_step(loaded, batch, drafts)
                best[batch, drafts] = min(best.get((batch, drafts), seconds), seconds)
    for batch in BATCHES:
        plain, spec = best[batch, 0], best[batch, k]
        print(f"B={batch:2d} decode {plain * 1000:6.1f} ms  k={k} {spec * 1000:6.1f} ms  "
              f"ratio {spec / plain:.2f}  break-even accepted per sequence-step {spec / plain - 1:.2f}")


if __name__ == "__main__":
    main()
