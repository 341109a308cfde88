"""`sft-bench` on Prefect's real engine: the demo's tasks and a task file of the user's score the tuned model and the
base side by side, a rerun is Cached, an edited task file reruns the stage, and the promotion gate reads the scores.

The "tuned" model is the base preset's own step-0 weights saved as a folder, so the two score alike and a rule
asking for a gain refuses it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from sftflow.flows.bench import sft_bench
from sftflow.flows.config import SFTConfig, keys_named, load_config
from sftflow.flows.data import sft_data
from sftflow.flows.promote import sft_promote
from sftflow.tasks.core.manifests import TrainResult
from tests.flows.conftest import RecordedTaskRuns
from tests.flows.test_train_resume import _artifact_keys

RECORDS = 40
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}


def _config(
    work: Path, tasks: list | None = None, demo_bench: bool = True, compare_champion: bool = True, **promote
) -> SFTConfig:
    return SFTConfig.model_validate(
        {
            "work_dir": str(work),
            "demo": {"records": RECORDS, "bench": demo_bench},
            "train": {"model": "tiny-llama", "model_overrides": TINY},
            "eval": {"max_docs": 4, "max_generations": 1},
            "bench": {"tasks": tasks or [], "compare_champion": compare_champion},
            "promote": {"registry": str(work / f"registry-{len(promote)}"), **promote},
        }
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from sftflow.tasks.data.index import load_index
    from sftflow.tasks.train.model import build_model

    work = tmp_path_factory.mktemp("bench")
    cfg = _config(work)
    data = sft_data(config=cfg)
    torch.manual_seed(cfg.train.seed)  # as the base preset is built: the same weights
    vocab = load_index(data.index.dir).meta["vocab_size"]
    build_model("tiny-llama", vocab_size=vocab, packed=False, overrides=TINY).save_pretrained(work / "step0")
    torch.manual_seed(1)
    build_model("tiny-llama", vocab_size=vocab, packed=False, overrides=TINY).save_pretrained(work / "other")
    return work, data, _trained(work / "step0")


def _trained(folder: Path) -> TrainResult:
    return TrainResult(
        run_dir=str(folder), steps=0, final_loss=None, trained_tokens=0, metrics_path="", checkpoint=None,
        hf_dir=str(folder),
    )  # fmt: skip


def _lines(*items: dict) -> str:
    return "".join(json.dumps(item) + "\n" for item in items)


def test_bench_is_cached_and_an_edited_task_file_reruns_it(setup, tmp_path):
    work, data, train = setup
    choice, generate = tmp_path / "choice.jsonl", tmp_path / "generate.jsonl"
    choice.write_text(
        _lines(
            {"question": "Capital of Peru?", "choices": ["Lima", "Oslo"], "answer": 0, "subset": "geography"},
            {"question": "What is 2 + 2?", "choices": ["4", "5"], "answer": 0, "subset": "math"},
        )
    )
    generate.write_text(_lines({"question": "What is 1 + 2?", "answer": "so #### 3"}))
    tasks = [
        {"name": "mine", "path": str(choice), "kind": "choice"},
        {
            "name": "sums",
            "path": str(generate),
            "kind": "generate",
            "reference_pattern": "#### (.+)",
            "max_new_tokens": 2,
        },
    ]
    cfg = _config(work, tasks=tasks, demo_bench=False)

    with RecordedTaskRuns() as runs:
        state = sft_bench(config=cfg, data=data, train=train, return_state=True)
    report = state.result()
    assert runs.states()["bench"] == ["Completed"]
    assert list(report.tasks) == ["mine", "sums"] and set(report.models) == {"base", "tuned"}
    samples = [json.loads(line) for line in Path(report.samples_path).read_text().splitlines()]
    assert [s["reference"] for s in samples] == ["Lima", "4", "so #### 3"]
    # Per-subset scores (the `mine` task's items name one; `sums`' do not) and the plot beside the report.
    markdown = Path(report.markdown_path).read_text()
    assert "## By subset" in markdown and "| mine | geography | 1 |" in markdown and "| mine | math | 1 |" in markdown
    assert "| sums |" not in markdown.split("## By subset")[1]
    plot = Path(report.plot_path)
    assert plot.parent == Path(report.path).parent and plot.name == "bench.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"Scores plot: `{plot}`" in markdown
    assert {"sft-bench-report", "sft-bench-scores", "sft-bench-subsets"} <= _artifact_keys(state)

    with RecordedTaskRuns() as runs:
        again = sft_bench(config=cfg, data=data, train=train)
    assert runs.states()["bench"] == ["Cached"] and again == report
    with RecordedTaskRuns() as runs:
        forced = sft_bench(config=cfg, data=data, train=train, force=True)
    assert runs.states()["bench"] == ["Completed"] and forced.tasks == report.tasks

    choice.write_text(_lines({"question": "Capital of Peru?", "choices": ["Oslo", "Lima"], "answer": 1}))
    with RecordedTaskRuns() as runs:
        edited = sft_bench(config=cfg, data=data, train=train)
    assert runs.states()["bench"] == ["Completed"] and edited.path != report.path


def test_the_demo_tasks_and_the_gate(setup):
    work, data, train = setup
    report = sft_bench(config=_config(work), data=data, train=train)
    assert report.tasks["arithmetic"].metric == "exact_match" and report.tasks["arithmetic"].items == 24
    assert report.tasks["capitals"].metric == "accuracy" and report.tasks["capitals"].items == 12
    for scores in report.tasks.values():
        assert scores.scores["base"] == scores.scores["tuned"]  # the same weights
    assert json.loads((work / "bench.json").read_text())["sha256"] == report.sha256  # what the gate reads
    markdown = Path(report.markdown_path).read_text()
    assert "| arithmetic | exact_match | 24 |" in markdown and "<|im_start|>user\nWhat is" in markdown

    refused = sft_promote(config=_config(work, bench_min_mean_gain=0.05), data=data, train=train)
    assert refused.decision == "kept" and refused.champion is None
    assert any("misses the +5.0 required" in r for r in refused.reasons), refused.reasons
    # No task fell below the base: the same model passes a regression rule (and, with no champion, is promoted).
    passed = sft_promote(config=_config(work, bench_max_regression=0.0), data=data, train=train, bench=report)
    assert passed.decision == "promoted", passed.reasons
    # bench.json scores the step-0 model: a gate on another candidate is refused before it evaluates anything.
    with pytest.raises(ValueError, match="benchmark scores are of another model than the candidate .*other"):
        sft_promote(config=_config(work, bench_max_regression=0.0), data=data, train=_trained(work / "other"))


def _picks_task(work: Path, data, folder: Path | None, out: Path) -> dict:
    """A choice task whose right answers are the picks of the model in `folder` (the base preset where None): that
    model scores 100%, one of other weights less. The choices are one token each: a random model's log-likelihoods
    otherwise mostly count a choice's tokens, so any two would pick the shortest alike."""
    from sftflow.flows.eval import base_model
    from sftflow.flows.train import trained_model
    from sftflow.tasks.eval.bench import choice_loglikelihoods, encode
    from sftflow.tasks.eval.stage import load_model

    questions = ["What is 1 + 2?", "Capital of Peru?", "Reverse abc", "What is 5 + 3?", "Capital of Cuba?"]
    choices = ["1", "2", "3", "4", "5", "6", "7", "8"]
    tokenizer = AutoTokenizer.from_pretrained(data.tokenizer.path)
    assert all(len(encode(tokenizer, c)) == 1 for c in choices)
    ref = base_model(_config(work)) if folder is None else trained_model(_trained(folder))
    model = load_model(ref, len(tokenizer))
    items = []
    for q in questions:
        loglik = choice_loglikelihoods(model, encode(tokenizer, f"{q}\n"), [encode(tokenizer, c) for c in choices])
        items.append({"question": q, "choices": choices, "answer": max(range(8), key=loglik.__getitem__)})
    out.write_text(_lines(*items))
    return {"name": "picks", "path": str(out), "kind": "choice", "chat": False}


def test_the_gate_refuses_a_model_that_regresses_on_a_task(setup, tmp_path):
    work, data, _ = setup
    task = _picks_task(work, data, None, tmp_path / "picks.jsonl")
    cfg = _config(work, tasks=[task], demo_bench=False, bench_max_regression=0.1, registry=str(tmp_path / "reg"))

    report = sft_bench(config=cfg, data=data, train=_trained(work / "other"))
    assert report.tasks["picks"].scores["base"] == 1.0
    assert report.tasks["picks"].scores["tuned"] < 0.9, "the other weights happen to pick as the base does"
    refused = sft_promote(config=cfg, data=data, train=_trained(work / "other"))
    assert refused.decision == "kept"
    assert "bench: no champion yet; compared with the base" in refused.reasons
    assert any(r.startswith("bench picks: accuracy") and "below the base's 100.0%" in r for r in refused.reasons)


def test_the_gate_compares_with_the_champion(setup, tmp_path):
    """The champion ("other" weights) answers every item right, the base less: a candidate with the base's weights
    does not regress against the base but does against the champion, and is refused, whether sft-bench scored the
    champion beside it or the gate reads the scores recorded in the champion's card."""
    from sftflow.tasks.eval.registry import Registry

    work, data, step0 = setup
    task = _picks_task(work, data, work / "other", tmp_path / "picks.jsonl")
    rules = {"bench_max_regression": 0.1, "registry": str(tmp_path / "registry")}
    cfg = _config(work, tasks=[task], demo_bench=False, **rules)
    recorded_only = _config(work, tasks=[task], demo_bench=False, compare_champion=False, **rules)

    first = sft_bench(config=cfg, data=data, train=_trained(work / "other"))
    assert first.tasks["picks"].scores["tuned"] == 1.0 and "champion" not in first.models
    assert first.tasks["picks"].scores["base"] < 0.9, "the base happens to pick as the other weights do"
    promoted = sft_promote(config=cfg, data=data, train=_trained(work / "other"), bench=first)
    assert promoted.decision == "promoted", promoted.reasons
    card = Registry(tmp_path / "registry").champion().card
    assert card["bench"]["picks"]["score"] == 1.0 and card["bench"]["picks"]["items"] == 5
    champion = promoted.champion

    scored = sft_bench(config=cfg, data=data, train=step0)
    picks = scored.tasks["picks"].scores
    assert picks["champion"] == 1.0 and picks["tuned"] == picks["base"]  # no regression against the base
    assert "| base | tuned | champion |" in Path(scored.markdown_path).read_text()  # a column of the tables
    recorded = sft_bench(config=recorded_only, data=data, train=step0)
    assert "champion" not in recorded.models
    for bench, compared in [
        (scored, f"bench: compared with champion {champion}, scored beside the candidate by sft-bench"),
        (recorded, f"bench: compared with champion {champion}'s recorded scores"),
    ]:
        refused = sft_promote(config=cfg, data=data, train=step0, bench=bench)
        assert refused.decision == "kept" and refused.champion == champion
        assert compared in refused.reasons
        assert any(
            r.startswith("bench picks: accuracy") and f"below the champion {champion}'s 100.0%" in r
            for r in refused.reasons
        ), refused.reasons

    # An edited task file: the card's scores are of other items, so the gate says so and compares with the base.
    items = Path(task["path"]).read_text().splitlines()
    Path(task["path"]).write_text("\n".join(items[:4]) + "\n")
    edited = sft_bench(config=recorded_only, data=data, train=step0)
    again = sft_promote(config=cfg, data=data, train=step0, bench=edited)
    assert any("no recorded score on the same task files for picks; compared with the base" in r for r in again.reasons)
    assert not any("below the" in r for r in again.reasons), again.reasons


def test_bench_rules_without_tasks_and_yaml_paths(tmp_path):
    with pytest.raises(ValueError, match="rules on benchmark scores need tasks"):
        SFTConfig.model_validate({"promote": {"bench_max_regression": 0.01}})
    # An unknown CLI option is pointed at `--set KEY`; a task's fields, inside a list, have no such key.
    assert keys_named("kind") == ["train.schedule.kind"]  # not the `kind` of bench.tasks' items
    assert keys_named("lm_eval_include") == ["bench.lm_eval_include"]
    (tmp_path / "tasks").mkdir()
    (tmp_path / "run.yaml").write_text("bench:\n  tasks:\n    - {name: t, path: tasks/t.jsonl, kind: choice}\n")
    cfg = load_config(tmp_path / "run.yaml")
    assert cfg.bench.tasks[0].path == str(tmp_path / "tasks" / "t.jsonl")  # relative to the config file
    with pytest.raises(ValueError, match="bench task t: file .*t.jsonl does not exist"):
        sft_bench(config=cfg)
