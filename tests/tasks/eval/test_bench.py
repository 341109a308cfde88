"""Benchmark scoring on a tiny random Llama: the stage's scores and answers equal a plain reference loop written here
(greedy decoding one full forward per token, log-likelihoods from one full forward per choice), task files with a
bad item are refused naming file, line and field, and the gate's benchmark rules."""

from __future__ import annotations

import json
import re

import pytest
import torch

from sftflow.tasks.core.manifests import BenchReport, BenchTaskScores, PromoteConfig
from sftflow.tasks.data.chat_template import load_template
from sftflow.tasks.eval.bench import extract, run_bench
from sftflow.tasks.eval.bench_config import BenchConfig, BenchTask, resolve_tasks
from sftflow.tasks.eval.bench_items import read_items, render_prompt, split_items
from sftflow.tasks.eval.promotion import decide_bench

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
QUESTIONS = ["What is 12 + 30?", "Reverse hello", "Capital of France?", "The quick brown fox", "system user"]


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    from sftflow.tasks.train.model import build_model

    torch.manual_seed(0)
    return build_model("tiny-llama", vocab_size=len(tiny_tokenizer), packed=False, overrides=TINY).eval()


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def _reference_greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    ids = _ids(tokenizer, prompt)
    new = []
    for _ in range(max_new_tokens):
        token = int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax())
        if token == tokenizer.eos_token_id:
            break
        new.append(token)
    return tokenizer.decode(new, skip_special_tokens=True).strip()


@torch.no_grad()
def _reference_loglik(model, tokenizer, prompt: str, choice: str) -> float:
    context, continuation = _ids(tokenizer, prompt), _ids(tokenizer, choice)
    logprobs = torch.log_softmax(model(input_ids=torch.tensor([context + continuation])).logits[0].float(), -1)
    return sum(float(logprobs[len(context) - 1 + i, t]) for i, t in enumerate(continuation))


def _write(path, items) -> str:
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return str(path)


def test_extract_takes_the_last_match_and_its_group():
    gsm = "Natalia sold 48/2 = 24 clips in May.\n#### 72"
    assert extract(gsm, r"#### (.+)") == "72"
    assert extract("so 3 + 4 = 7, the answer is 7.", r"-?\d+") == "7"
    assert extract("no digits here", r"-?\d+") is None
    assert extract("  Paris \n", None) == "Paris"


@pytest.mark.parametrize("chat", [True, False])
def test_generate_scores_equal_the_reference_loop(tmp_path, model, tiny_tokenizer, chat):
    template = load_template("chatml", tiny_tokenizer)
    task = BenchTask(
        name="gen", path="x", kind="generate", answer_pattern=r"(\S+)$", max_new_tokens=6, chat=chat, num_fewshot=1
    )
    fewshot = [{"question": "What is 1 + 1?", "answer": "2"}]
    items = [{"question": q, "answer": "?"} for q in QUESTIONS]
    shots, scored = split_items(read_items(_write(tmp_path / "p.jsonl", fewshot + items), task), task)
    prompts = [render_prompt(item, shots, template if chat else None) for item in scored]
    assert len(prompts) == len(QUESTIONS) and "What is 1 + 1?" in prompts[0]
    outputs = [_reference_greedy(model, tiny_tokenizer, p, 6) for p in prompts]
    # Items 0, 2, 4 carry the answer the reference loop extracts (as `answer ####` GSM8K-style references), the
    # others a wrong one: the score is 3/5 exactly when the stage decodes and extracts as the reference does.
    answers = [extract(o, r"(\S+)$") for o in outputs]
    assert all(a is not None for a in answers), outputs
    items = [
        {"question": q, "answer": f"work {i} #### {a if i % 2 == 0 else 'wrong'}"}
        for i, (q, a) in enumerate(zip(QUESTIONS, answers, strict=True))
    ]
    path = _write(tmp_path / "gen.jsonl", fewshot + items)
    config = BenchConfig(tasks=[task.model_copy(update={"path": path, "reference_pattern": "#### (.+)"})])
    [result] = run_bench({"tuned": model}, tiny_tokenizer, template, resolve_tasks(config))
    assert result.metric == "exact_match" and result.items == len(QUESTIONS)
    assert result.scores == {"tuned": pytest.approx(3 / 5)}
    assert [s["tuned"]["output"] for s in result.samples] == outputs
    assert [s["line"] for s in result.samples] == [2, 3, 4, 5, 6]
    assert result.prompt_example == prompts[0]


def test_choice_scores_equal_the_reference_loop(tmp_path, model, tiny_tokenizer):
    template = load_template("chatml", tiny_tokenizer)
    choices = ["Paris", "Tokyo", "a longer answer", "42"]
    task = BenchTask(name="mc", path="x", kind="choice")
    picks = []
    for q in QUESTIONS:
        prompt = render_prompt(read_items(_write(tmp_path / "one.jsonl", [_mc(q, choices, 0)]), task)[0], [], template)
        logliks = [_reference_loglik(model, tiny_tokenizer, prompt, c) for c in choices]
        picks.append((max(range(4), key=logliks.__getitem__), logliks))
    # Right answers: the reference's pick for the first three items, another choice for the last two; answers given
    # by index and by text.
    # Subsets: the first two items "geo" (both right), the next two "math" (one right), the last none ("other").
    subsets = ["geo", "geo", "math", "math", None]
    items = [
        {
            **_mc(q, choices, pick if i < 3 else (pick + 1) % 4, by_text=i % 2 == 1),
            **({"subset": subsets[i]} if subsets[i] else {}),
        }
        for i, (q, (pick, _)) in enumerate(zip(QUESTIONS, picks, strict=True))
    ]
    path = _write(tmp_path / "mc.jsonl", items)
    [result] = run_bench(
        {"base": model, "tuned": model},
        tiny_tokenizer,
        template,
        resolve_tasks(BenchConfig(tasks=[task.model_copy(update={"path": path})])),
    )
    assert result.metric == "accuracy"
    assert result.scores == {"base": pytest.approx(3 / 5), "tuned": pytest.approx(3 / 5)}
    assert result.subsets == {
        "geo": {"items": 2, "scores": {"base": 1.0, "tuned": 1.0}},
        "math": {"items": 2, "scores": {"base": 0.5, "tuned": 0.5}},
        "other": {"items": 1, "scores": {"base": 0.0, "tuned": 0.0}},
    }
    for sample, (pick, logliks) in zip(result.samples, picks, strict=True):
        assert sample["tuned"]["choice"] == choices[pick]
        assert sample["tuned"]["loglikelihoods"] == pytest.approx(logliks, abs=1e-4)


def _mc(question: str, choices: list[str], answer: int, by_text: bool = False) -> dict:
    return {"question": question, "choices": choices, "answer": choices[answer] if by_text else answer}


def test_few_shot_prompts_are_solved_turns_before_the_question(tmp_path, tiny_tokenizer):
    task = BenchTask(name="g", path="x", kind="generate", num_fewshot=2, limit=1)
    items = [{"question": f"q{i}", "answer": f"a{i}"} for i in range(5)]
    fewshot, scored = split_items(read_items(_write(tmp_path / "t.jsonl", items), task), task)
    assert [i.question for i in fewshot] == ["q0", "q1"] and [i.question for i in scored] == ["q2"]
    assert render_prompt(scored[0], fewshot, None) == "q0\na0\n\nq1\na1\n\nq2\n"
    chat = render_prompt(scored[0], fewshot, load_template("chatml", tiny_tokenizer))
    assert re.findall(r"<\|im_start\|>(\w+)\n(\w*)", chat) == [
        ("user", "q0"),
        ("assistant", "a0"),
        ("user", "q1"),
        ("assistant", "a1"),
        ("user", "q2"),
        ("assistant", ""),
    ]


@pytest.mark.parametrize(
    ("kind", "line", "message"),
    [
        ("generate", '{"answer": "4"}', ":2: field 'question' must be a non-empty string"),
        ("generate", '{"question": "q", "answer": ["4"]}', ":2: field 'answer' must be a string"),
        ("generate", "[1, 2]", ":2: not a JSON object"),
        ("generate", '{"question": "q", "answer": "4", "subset": 3}', ":2: field 'subset' must be a non-empty"),
        ("choice", '{"question": "q", "choices": ["a"], "answer": 0}', ":2: field 'choices' must be a list"),
        ("choice", '{"question": "q", "choices": ["a", "b"], "answer": 2}', ":2: field 'answer' is 2; expected"),
        ("choice", '{"question": "q", "choices": ["a", "b"], "answer": "c"}', ":2: field 'answer' must be the right"),
    ],
)
def test_a_bad_item_is_refused_naming_file_line_and_field(tmp_path, kind, line, message):
    good = {"question": "q", "answer": "a", **({"choices": ["a", "b"]} if kind == "choice" else {})}
    path = tmp_path / "task.jsonl"
    path.write_text(json.dumps(good) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}{message}")):
        read_items(path, BenchTask(name="t", path=str(path), kind=kind))


def test_config_refuses_a_bad_pattern_and_repeated_names():
    with pytest.raises(ValueError, match="not a valid regular expression"):
        BenchTask(name="t", path="x", kind="generate", answer_pattern="(")
    with pytest.raises(ValueError, match=r"two tasks are named \['t'\]"):
        BenchConfig(tasks=[BenchTask(name="t", path="x", kind="choice")] * 2)


def test_lm_eval_tasks_without_lm_eval_say_which_extra_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as where it is not installed
    with pytest.raises(ValueError, match=r"pip install 'sftflow\[bench\]'"):
        BenchConfig(lm_eval_tasks=["gsm8k"])
    assert not BenchConfig(tasks=[]).enabled  # local tasks alone never need it


def _report(**scores: tuple[float, float]) -> BenchReport:
    tasks = {
        name: BenchTaskScores(metric="accuracy", items=10, scores={"base": base, "tuned": tuned})
        for name, (base, tuned) in scores.items()
    }
    return BenchReport(path="r", sha256="x", tasks=tasks, models={}, markdown_path="", samples_path="")


def test_the_gate_refuses_a_task_that_regresses_and_a_mean_below_the_bar():
    report = _report(arithmetic=(0.2, 0.9), capitals=(0.5, 0.46))
    ok, reasons = decide_bench(report, PromoteConfig(bench_max_regression=0.05, bench_min_mean_gain=0.3))
    assert ok, reasons
    ok, reasons = decide_bench(report, PromoteConfig(bench_max_regression=0.01))
    assert not ok
    assert reasons == ["bench capitals: accuracy 46.0% fell 4.0 points below the base's 50.0% (at most 1.0 allowed)"]
    ok, reasons = decide_bench(report, PromoteConfig(bench_min_mean_gain=0.5))
    assert not ok and reasons == ["bench mean 68.0% vs the base's 35.0%: +33.0 points misses the +50.0 required"]


def test_trackers_get_the_benchmark_scores(tmp_path):
    """The scores reach a real tracker (TensorBoard's event files) as `bench/<model>/<task>/<metric>` scalars."""
    pytest.importorskip("tensorboard", reason="needs the track extra (tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sftflow.tasks.track.config import TrackConfig
    from sftflow.tasks.track.record import RunRecord
    from sftflow.tasks.track.stage import send

    tasks = _report(arithmetic=(0.0, 0.625)).tasks
    record = RunRecord(name="run", params={}, steps=[{"step": 1, "loss": 1.0}], eval={}, final_step=1, bench=tasks)
    (sent,) = send(record, TrackConfig(tensorboard=True), tmp_path, {})
    events = EventAccumulator(sent.url)
    events.Reload()
    assert events.Scalars("bench/tuned/arithmetic/accuracy")[0].value == pytest.approx(0.625)
    assert events.Scalars("bench/base/arithmetic/accuracy")[0].value == 0.0
