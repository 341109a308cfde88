"""lm-evaluation-harness as the `bench` extra: a task YAML of the user's over a local JSONL file, scored by lm-eval on
a tiny model, gives the accuracy the built-in multiple-choice loop gives on the same items and prompts. Skipped where
lm-eval is not installed (CI installs no extras but `test`)."""

from __future__ import annotations

import json

import pytest
import torch

from sftflow.tasks.eval.bench import run_bench
from sftflow.tasks.eval.bench_config import BenchConfig, BenchTask, resolve_tasks

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
ITEMS = [
    {"question": "Capital of France?", "choices": ["Paris", "Tokyo", "Rome"], "answer": 0},
    {"question": "What is 12 + 30?", "choices": ["42", "12", "30"], "answer": 0},
    {"question": "Reverse hello", "choices": ["olleh", "hello", "lloeh"], "answer": 0},
    {"question": "The quick brown fox", "choices": ["jumps", "dog", "lazy"], "answer": 1},
]
TASK_YAML = """task: local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}\\n"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
"""


def test_an_lm_eval_task_over_a_local_file_scores_as_the_built_in_loop(tmp_path, tiny_tokenizer, monkeypatch):
    pytest.importorskip("lm_eval")
    from sftflow.tasks.eval.bench_lm_eval import run_lm_eval
    from sftflow.tasks.train.model import build_model

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "tasks" / "mc.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (tmp_path / "tasks" / "local_mc.yaml").write_text(TASK_YAML.format(path=data))
    torch.manual_seed(0)
    model = build_model("tiny-llama", vocab_size=len(tiny_tokenizer), packed=False, overrides=TINY).eval()

    [ours] = run_bench(
        {"tuned": model},
        tiny_tokenizer,
        None,
        resolve_tasks(BenchConfig(tasks=[BenchTask(name="mc", path=str(data), kind="choice", chat=False)])),
    )
    [theirs] = run_lm_eval({"tuned": model}, tiny_tokenizer, ["local_mc"], str(tmp_path / "tasks"))
    assert theirs.metric == "acc" and theirs.items == len(ITEMS)
    assert theirs.scores == pytest.approx(ours.scores)
