"""lm-evaluation-harness against `kubeinfer serve`, through its `local-completions` backend, as a
platform team checks a deployment: a loglikelihood (multiple-choice) task and a generate_until
task, both defined here (no dataset hub), give the same per-sample loglikelihoods (within 1e-3)
and the same generations as lm-eval's own `hf` backend on the same weights (float32)."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import pytest
from helpers.serve_process import free_port, start_kubeinfer
from helpers.tiny_models import make_tiny_llama

pytestmark = pytest.mark.integration

TASKS = ("kubeinfer_choice", "kubeinfer_answer")
CHOICE_TASK = """task: kubeinfer_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
ANSWER_TASK = """task: kubeinfer_answer
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def write_tasks(root: Path) -> Path:
    """The two task YAMLs over local JSON-lines data; returns their folder (lm-eval's include_path)."""
    choices = [{"question": f"Question {i}: which words follow the fox?", "answer": i % 3,
                "choices": [" jumps", " sleeps soundly", " runs over the hill"]} for i in range(6)]
    answers = [{"question": f"Say {word}:", "answer": f" {word}"} for word in ("yes", "no", "maybe", "ok")]
    tasks = root / "tasks"
    tasks.mkdir()
    for name, rows, template in (("choice", choices, CHOICE_TASK), ("answer", answers, ANSWER_TASK)):
        data = root / f"{name}.jsonl"
        data.write_text("\n".join(map(json.dumps, rows)) + "\n")
        (tasks / f"{name}.yaml").write_text(template.format(data=data))
    return tasks


def test_local_completions_matches_the_hf_backend(tmp_path, monkeypatch) -> None:
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import lm_eval
    from lm_eval.tasks import TaskManager

    model = make_tiny_llama(tmp_path / "model")
    tasks = TaskManager(include_path=str(write_tasks(tmp_path)))
    with ExitStack() as stack:
        port = free_port()
        start_kubeinfer(["serve", "--model", str(model), "--dtype", "float32", "--served-model-name", "tiny",
                         "--kv-cache-memory", "16MiB", "--max-model-len", "1024"], port, stack)
        served = lm_eval.simple_evaluate(
            model="local-completions", tasks=list(TASKS), task_manager=tasks, log_samples=True,
            model_args=f"base_url=http://127.0.0.1:{port}/v1/completions,model=tiny,num_concurrent=2,"
                       f"max_retries=1,tokenized_requests=True,tokenizer_backend=huggingface,tokenizer={model}")
    local = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model},dtype=float32", device="cpu",
                                    tasks=list(TASKS), task_manager=tasks, log_samples=True)
    ours, theirs = served["samples"]["kubeinfer_choice"], local["samples"]["kubeinfer_choice"]
    assert len(ours) == len(theirs) == 6
    for mine, reference in zip(ours, theirs):
        assert mine["doc_id"] == reference["doc_id"]
        for (loglikelihood, greedy), (expected, expected_greedy) in zip(mine["filtered_resps"],
                                                                         reference["filtered_resps"], strict=True):
            assert loglikelihood == pytest.approx(expected, abs=1e-3) and greedy == expected_greedy
    generated = [sample["filtered_resps"] for sample in served["samples"]["kubeinfer_answer"]]
    assert len(generated) == 4 and generated == [s["filtered_resps"] for s in local["samples"]["kubeinfer_answer"]]
    assert served["results"]["kubeinfer_choice"]["acc,none"] == local["results"]["kubeinfer_choice"]["acc,none"]
