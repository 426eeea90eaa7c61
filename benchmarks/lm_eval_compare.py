"""Compares lm-eval runs (their --output_path folders, with --log_samples): scores, and per
sample the loglikelihoods (max |difference|) and generations (how many equal) against the first.

    python benchmarks/lm_eval_compare.py RESULTS/kubeinfer RESULTS/vllm
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(folder: Path) -> tuple[dict, dict[str, list[dict]]]:
    results = json.loads(max(folder.rglob("results_*.json")).read_text())
    samples = {}
    for path in folder.rglob("samples_*.jsonl"):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        samples[task] = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])
    return results, samples


def main(folders: list[Path]) -> None:
    base_results, base = load(folders[0])
    for folder in folders:
        results, samples = load(folder)
        scores = {task: {k: v for k, v in values.items() if "," in k and "stderr" not in k}
                  for task, values in results["results"].items()}
        print(f"{folder.name}: {json.dumps(scores)}")
        for task, rows in samples.items():
            pairs = list(zip(base[task], rows, strict=True))
            if isinstance(rows[0]["filtered_resps"][0], list):   # loglikelihood: [logprob, is_greedy] per choice
                diffs = [abs(float(a[0]) - float(b[0])) for x, y in pairs
                         for a, b in zip(x["filtered_resps"], y["filtered_resps"], strict=True)]
                print(f"  {task}: {len(diffs)} loglikelihoods, max |diff| vs {folders[0].name} {max(diffs):.2e}")
            else:
                same = sum(x["filtered_resps"] == y["filtered_resps"] for x, y in pairs)
                print(f"  {task}: {same}/{len(pairs)} generations equal to {folders[0].name}'s")


if __name__ == "__main__":
    main([Path(arg) for arg in sys.argv[1:]])
