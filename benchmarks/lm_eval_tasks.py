"""Writes two local lm-evaluation-harness tasks (no dataset hub): `kubeinfer_arith_choice`, a
multiple-choice (loglikelihood) task, and `kubeinfer_arith_answer`, a generate_until task, both
"What is a plus b?" over seeded numbers; `benchmarks/lm_eval_peers.sh` runs them against
kubeinfer and vLLM-CPU.

    python benchmarks/lm_eval_tasks.py OUT_DIR [--docs 100]   # then lm_eval --include_path OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CHOICE = """task: kubeinfer_arith_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is {{{{a}}}} plus {{{{b}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
ANSWER = """task: kubeinfer_arith_answer
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: What is {{{{a}}}} plus {{{{b}}}}?\\nAnswer:"
doc_to_target: " {{{{sum}}}}"
generation_kwargs:
  until: ["\\n", "Question:"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def write(out: Path, docs: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    rows = []
    for _ in range(docs):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        wrong = rng.sample(sorted({a + b + 1, a + b - 1, a + b + 10, a * b} - {a + b}), 3)
        choices = [f" {value}" for value in [a + b, *wrong]]
        rng.shuffle(choices)
        rows.append({"a": a, "b": b, "sum": a + b, "choices": choices, "answer": choices.index(f" {a + b}")})
    out.mkdir(parents=True, exist_ok=True)
    data = out / "arith.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (out / "arith_choice.yaml").write_text(CHOICE.format(data=data.resolve()))
    (out / "arith_answer.yaml").write_text(ANSWER.format(data=data.resolve()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--docs", type=int, default=100)
    args = parser.parse_args()
    write(args.out, args.docs)
