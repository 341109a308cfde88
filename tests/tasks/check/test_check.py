"""`sftflow check`: each check passes on sftflow's real pipeline and fails, with the measured difference, when a mask,
a stop or an attention window is wrong."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from sftflow.flows.check import run_checks
from sftflow.flows.cli import app
from sftflow.flows.config import SFTConfig
from sftflow.tasks.check.loss import compare_first_step, loss_rows
from sftflow.tasks.check.results import CheckReport
from sftflow.tasks.check.sample import sample_docs, sample_records
from sftflow.tasks.check.template import ids_and_masks_match_hf, ids_match_own_template, one_stop_per_trained_turn
from sftflow.tasks.data.render import RenderConfig, resolve_template
from sftflow.tasks.data.spans import SpansConfig, mask_to_spans
from tests.tasks.data.test_spans import CONVERSATIONS
from tests.tasks.family_configs import FAMILY_CONFIGS, save_family_model

# A ChatML template whose generation block leaves the assistant's <|im_end|> out: Hugging Face's mask agrees with it
# (the tags say so), and the model would never learn to stop.
STOP_OUTSIDE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}{% endgeneration %}<|im_end|>\n{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
)


def _write(path: Path, names) -> Path:
    path.write_text("".join(json.dumps(CONVERSATIONS[name]) + "\n" for name in names))
    return path


@pytest.fixture
def source(tmp_path) -> Path:
    return _write(tmp_path / "chats.jsonl", CONVERSATIONS)


@pytest.fixture
def plain_source(tmp_path) -> Path:
    """Without the tool call, whose empty content STOP_OUTSIDE cannot render."""
    return _write(tmp_path / "plain.jsonl", ["multi_turn", "unicode"])


def _docs(tokenizer, source: Path, render: RenderConfig = RenderConfig(), spans: SpansConfig = SpansConfig()):
    template = resolve_template(render, tokenizer.name_or_path)
    return sample_docs(sample_records([str(source)], 8, render), template, tokenizer, render, spans), template


def _config(tmp_path, source, tokenizer_dir, model, **sections) -> SFTConfig:
    raw = {
        "work_dir": str(tmp_path / "work"),
        "data": {"sources": [str(source)], "tokenizer": str(tokenizer_dir), **sections.pop("data", {})},
        "train": {"model": str(model)},
        "check": {"device": "cpu", "steps": 0},
        **sections,
    }
    return SFTConfig.model_validate(raw)


def test_every_check_passes_on_a_model_folder_and_its_tokenizer(tmp_path, source, tiny_tokenizer, tiny_tokenizer_dir):
    model = save_family_model("llama3_untied", len(tiny_tokenizer), tmp_path / "model")
    report = run_checks(_config(tmp_path, source, tiny_tokenizer_dir, model))
    assert [r.name for r in report.rows] == [
        "ids and masks = HF",
        "one stop per trained turn",
        "first-step loss = HF eager",
        "first-step grads = HF eager",
    ]
    assert report.passed and report.exit_code == 0, report.table()
    assert report.rows[0].measured.startswith(f"ids {len(CONVERSATIONS)}/{len(CONVERSATIONS)} equal, masks")
    assert report.rows[1].measured == "6/6 turns"  # the three conversations' assistant turns


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_loss_check_holds_on_a_tiny_model_of_every_family(name, tmp_path, source, tiny_tokenizer):
    docs, _ = _docs(tiny_tokenizer, source)
    folder = save_family_model(name, len(tiny_tokenizer), tmp_path / name)
    result = compare_first_step(
        str(folder), [d.trained for d in docs], vocab_size=len(tiny_tokenizer), device=__import__("torch").device("cpu")
    )
    assert result.docs == len(CONVERSATIONS) and result.targets > 0
    assert all(row.passed for row in loss_rows(result, 1e-5, 1e-4, 0, "packed")), result


def test_loss_check_of_a_padded_plan_runs_the_models_own_attention(tmp_path, source, tiny_tokenizer):
    """`plan.mode: padded`: one document a row with the stock attention and its mask, against the same reference."""
    import torch

    docs, _ = _docs(tiny_tokenizer, source)
    folder = save_family_model("qwen2_5", len(tiny_tokenizer), tmp_path / "qwen2_5")
    result = compare_first_step(
        str(folder), [d.trained for d in docs], vocab_size=len(tiny_tokenizer), device=torch.device("cpu"), packed=False
    )
    assert all(row.passed for row in loss_rows(result, 1e-5, 1e-4, 0, "padded")), result


def test_a_dropped_sliding_window_fails_the_loss_check(tmp_path, source, tiny_tokenizer, monkeypatch):
    """sftflow's attention made to ignore Mistral's window (the reference keeps it): both rows fail."""
    import torch

    from sftflow.tasks.train import model as model_module

    attend = model_module.varlen_attention

    def without_window(q, k, v, cu_seqlens, max_seqlen, scale=None, window=None, **kw):
        return attend(q, k, v, cu_seqlens, max_seqlen, scale, None, **kw)

    monkeypatch.setattr(model_module, "varlen_attention", without_window)
    docs, _ = _docs(tiny_tokenizer, source)
    folder = save_family_model("mistral", len(tiny_tokenizer), tmp_path / "mistral")
    result = compare_first_step(
        str(folder), [d.trained for d in docs], vocab_size=len(tiny_tokenizer), device=torch.device("cpu")
    )
    loss, grads = loss_rows(result, 1e-5, 1e-4, 0, "packed")
    assert not loss.passed and not grads.passed
    assert result.loss_rel_err > 1e-4 and f"rel {result.loss_rel_err:.1e}" in loss.measured


def test_a_wrong_mask_fails_the_hf_check_naming_the_record_and_token(tiny_tokenizer, source):
    docs, template = _docs(tiny_tokenizer, source)
    assert ids_and_masks_match_hf(docs, tiny_tokenizer, template, "generation").passed
    wrong = docs[1].templated
    mask = wrong.loss_mask()
    k = int(np.flatnonzero(mask)[0]) - 1  # the token before the first trained one: the role cue's newline
    mask[k] = 1
    docs[1] = dataclasses.replace(docs[1], templated=dataclasses.replace(wrong, loss_spans_S2=mask_to_spans(mask)))
    row = ids_and_masks_match_hf(docs, tiny_tokenizer, template, "generation")
    assert not row.passed
    assert "masks 2/3 (1 tok off)" in row.measured
    assert row.detail.startswith(f"{docs[1].source}: 1 token(s) differ, first {k}")


def test_a_template_without_generation_tags_is_compared_on_ids_only_and_says_so(tiny_tokenizer, source):
    render = RenderConfig(template=None, mask_policy="roles")
    docs, template = _docs(tiny_tokenizer, source, render)
    untagged = type(template)(template.text.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    row = ids_and_masks_match_hf(docs, tiny_tokenizer, untagged, "roles")
    assert row.passed and row.name == "ids = HF" and "masks not" in row.detail


def test_ids_are_compared_with_the_tokenizers_own_template_when_the_data_uses_another(tiny_tokenizer, tmp_path, source):
    docs, template = _docs(tiny_tokenizer, source)
    assert ids_match_own_template(docs, tiny_tokenizer, template) is None  # the data is rendered with it
    spaced = tmp_path / "spaced.jinja"
    spaced.write_text(tiny_tokenizer.chat_template.replace("'<|im_start|>'", "'<|im_start|> '"))
    docs, other = _docs(tiny_tokenizer, source, RenderConfig(template=str(spaced)))
    row = ids_match_own_template(docs, tiny_tokenizer, other)
    assert not row.passed and not row.required and row.result == "differs"
    assert row.measured == "ids 0/3 equal" and "(the export ships the former)" in row.detail
    assert CheckReport(rows=[row]).exit_code == 0  # reported, not failed


def test_a_turn_whose_stop_is_not_trained_fails_and_the_command_exits_1(tmp_path, plain_source, tiny_tokenizer_dir):
    template = tmp_path / "stop_outside.jinja"
    template.write_text(STOP_OUTSIDE)
    model = save_family_model("llama3_tied", 400, tmp_path / "model")
    config = tmp_path / "run.yaml"
    data = {"sources": [str(plain_source)], "tokenizer": str(tiny_tokenizer_dir)}
    data["render"] = {"template": str(template)}
    data["spans"] = {"eos": "never"}
    check = {"device": "cpu", "steps": 0}
    config.write_text(json.dumps({"data": data, "train": {"model": str(model)}, "check": check}))
    result = CliRunner().invoke(app, ["check", str(config), "--work-dir", str(tmp_path / "work")])
    assert result.exit_code == 1, result.output
    lines = {line.split()[0] + " " + line.split()[1]: line for line in result.output.splitlines() if "  " in line}
    assert "PASS" in lines["ids and"]  # Hugging Face's mask follows the same tags
    assert "FAIL" in lines["one stop"] and "0/4 turns" in lines["one stop"]
    assert "has no stop" in result.output and "check(s) FAILED" in result.output


def test_eos_auto_does_not_mend_turns_whose_stop_is_untrained(tiny_tokenizer, tmp_path, plain_source):
    """`eos: auto` adds EOS only after a trained last token; here each turn ends in its untrained <|im_end|>."""
    template = tmp_path / "stop_outside.jinja"
    template.write_text(STOP_OUTSIDE)
    render = RenderConfig(template=str(template), template_tokens=())
    docs, _ = _docs(tiny_tokenizer, plain_source, render)
    row = one_stop_per_trained_turn(docs, tiny_tokenizer)
    assert not row.passed and row.measured == "0/4 turns"


def test_the_command_passes_on_the_bundled_demo(tmp_path):
    result = CliRunner().invoke(app, ["check", "--work-dir", str(tmp_path), "--set", "check.steps=0"])
    assert result.exit_code == 0, result.output
    rows = [line.split("  ")[0] for line in result.output.splitlines() if "  PASS  " in line]
    assert rows == [
        "ids and masks = HF",
        "one stop per trained turn",
        "first-step loss = HF eager",
        "first-step grads = HF eager",
    ]
    assert "all checks pass" in result.output


def test_bad_input_is_one_line_and_exit_2(tmp_path, tiny_tokenizer_dir):
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"data": {"sources": ["missing.jsonl"], "tokenizer": str(tiny_tokenizer_dir)}}))
    result = CliRunner().invoke(app, ["check", str(config)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "missing.jsonl" in result.output and len(result.output.strip().splitlines()) == 1, result.output


def test_real_tokenizers_ids_and_masks_equal_hf(shared_data, tmp_path):
    """Every shared tokenizer with the template `auto` picks for it: ids and masks equal Hugging Face's on tool-call
    and plain conversations; on the plain ones the ids also equal the tokenizer's own template's."""
    from transformers import AutoTokenizer

    from sftflow.tasks.data.formats import normalize_record

    sources = {}
    for name, rel in [
        ("tools", "datasets/glaive-toolcall-en-demo/glaive_toolcall_en_demo.json"),
        ("plain", "datasets/fastchat-dummy-conversation/dummy_conversation.json"),
    ]:
        if not (shared_data / rel).is_file():
            pytest.skip(f"{rel} is absent")
        sources[name] = tmp_path / f"{name}.jsonl"
        with sources[name].open("w") as f:
            for i, raw in enumerate(json.loads((shared_data / rel).read_text())[:6]):
                conv = normalize_record(raw, "sharegpt", f"{rel}:{i}")
                f.write(json.dumps({"messages": conv.messages, "tools": conv.tools}) + "\n")
    for folder in sorted(p for p in (shared_data / "tokenizers").iterdir() if p.is_dir()):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        for name, source in sources.items():
            docs, template = _docs(tokenizer, source)
            row = ids_and_masks_match_hf(docs, tokenizer, template, "generation")
            assert row.passed and row.measured.startswith("ids 6/6 equal, masks 6/6"), (folder.name, name, row)
            own = ids_match_own_template(docs, tokenizer, template)
            if name == "plain" and own is not None:
                assert own.passed, (folder.name, own)


@pytest.mark.slow
def test_training_checks_pass_on_the_real_launcher(tmp_path, source, tiny_tokenizer, tiny_tokenizer_dir):
    """Four torchrun launches (2 ranks, 1 rank, killed after step 1's checkpoint, resumed) of two steps on the
    sample."""
    from sftflow.tasks.check.training import run_training_checks, training_rows
    from sftflow.tasks.train.config import TrainOptions

    docs, _ = _docs(tiny_tokenizer, source)
    model = save_family_model("qwen2_5", len(tiny_tokenizer), tmp_path / "model")
    options = TrainOptions(model=str(model), optimizer=dict(lr=1e-3), schedule=dict(warmup_steps=0))
    trained = [d.trained for d in docs]
    runs = run_training_checks(options, trained, len(tiny_tokenizer), str(tiny_tokenizer_dir), tmp_path / "runs", 2)
    ranks, resume = training_rows(*runs, 2, 1e-4)
    assert ranks.passed and resume.passed, (ranks, resume)
    assert resume.measured == f"losses 1/1, tensors {len(runs[0].weights)}/{len(runs[0].weights)} bit-equal"
    kill = runs[2].kill  # killed in step 2 (or its checkpoint save), after step 1's checkpoint
    assert kill.landed and kill.latest == 1 and kill.logged_steps[0] == 1 and kill.processes >= 4, kill
    assert resume.detail.endswith("resumed from the step-1 checkpoint to step 2")


def test_training_rows_fail_on_a_resume_that_differs_and_ranks_that_drift():
    """The comparison itself: a resumed run one ulp off at step 2 fails the bit-exact row, naming the step; a
    one-rank run off by 1e-3 fails the ranks row."""
    import torch

    from sftflow.tasks.check.training import RunRecord, training_rows

    weights = {"model.w": torch.arange(6, dtype=torch.float32)}
    two = RunRecord(losses={1: 3.0, 2: 2.5}, weights=weights)
    resumed = RunRecord(losses={2: float(np.nextafter(2.5, 3.0))}, weights=dict(weights))
    one = RunRecord(losses={1: 3.0, 2: 2.5 * (1 + 1e-3)}, weights=dict(weights))
    ranks, resume = training_rows(two, one, resumed, 2, 1e-4)
    assert not ranks.passed and ranks.measured.startswith("losses rel 1.0e-03")
    assert not resume.passed and resume.measured == "losses 0/1, tensors 1/1 bit-equal"
    assert resume.detail.startswith("step 2: loss 2.5000000000000004 resumed")
    ranks, resume = training_rows(two, two, two, 2, 1e-4)
    assert ranks.passed and resume.passed


@pytest.mark.slow
def test_the_kill_lands_between_the_first_checkpoint_and_the_end_and_the_resume_continues_from_it(
    tmp_path, source, tiny_tokenizer, tiny_tokenizer_dir, caplog
):
    """The real launcher SIGKILLed with torchrun and both workers: none of them is left, the killed run's metrics stop
    before its last step, and the normal resume starts from the checkpoint `latest` named and trains to the end."""
    from sftflow.tasks.check.kill import kill_after_a_checkpoint
    from sftflow.tasks.core.locks import process_alive
    from sftflow.tasks.train.launch import train

    config = _run_to_kill(tmp_path, source, tiny_tokenizer, tiny_tokenizer_dir, max_steps=3)
    kill = kill_after_a_checkpoint(config)  # lands after the first checkpoint found, in all but a starved run
    assert kill.landed and 1 <= kill.latest < 3, kill
    assert kill.processes >= 4  # the launcher, torchrun, 2 workers
    assert kill.logged_steps[0] == 1 and max(kill.logged_steps) < 3
    with caplog.at_level(logging.INFO, logger="sftflow.train"):
        train(config, resume=True)  # waits for the killed workers' lock on the run to go
    assert not [pid for pid in kill.pids if process_alive(pid) and not _zombie(pid)]
    assert f"resumed all components from {tmp_path / 'run' / 'checkpoints' / f'step-{kill.latest}'}" in caplog.text
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


@pytest.mark.slow
def test_a_run_whose_only_checkpoint_is_its_last_is_never_counted_as_killed(
    tmp_path, source, tiny_tokenizer, tiny_tokenizer_dir
):
    """Nothing left to resume after the kill: not landed, tried twice, each time from an empty folder."""
    from sftflow.tasks.check.kill import kill_after_a_checkpoint

    config = _run_to_kill(
        tmp_path, source, tiny_tokenizer, tiny_tokenizer_dir, max_steps=2, checkpoint=dict(every=100, keep_last=4)
    )
    kill = kill_after_a_checkpoint(config)
    assert not kill.landed and kill.attempts == 2 and kill.latest == 2, kill
    assert kill.logged_steps == (1, 2)


def _run_to_kill(tmp_path, source, tiny_tokenizer, tiny_tokenizer_dir, **fields):
    """The 2-process CPU run the kill checks launch, on the sample planned for 3 steps."""
    from sftflow.tasks.check.training import sample_plan
    from sftflow.tasks.train.config import TrainConfig

    docs, _ = _docs(tiny_tokenizer, source)
    model = save_family_model("qwen2_5", len(tiny_tokenizer), tmp_path / "model")
    index, plan = sample_plan([d.trained for d in docs], len(tiny_tokenizer), tmp_path / "data", 3, seed=0)
    fields = dict(
        model=str(model), data=str(index), plan=str(plan), tokenizer=str(tiny_tokenizer_dir), out=str(tmp_path / "run"),
        nproc=2, checkpoint=dict(every=1, keep_last=4), export=False, device="cpu",
        memory=dict(dtype="fp32", compile="off"), parallel="fsdp", num_threads=1, optimizer=dict(lr=1e-3),
        schedule=dict(warmup_steps=0),
    ) | fields  # fmt: skip
    return TrainConfig(**fields)


def _zombie(pid: int) -> bool:
    """Dead and not yet reaped (a killed worker's new parent reaps it when it gets to it)."""
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def test_a_run_that_ended_before_the_kill_fails_the_kill_row_and_says_so():
    """No kill landed (twice): the row fails, rather than passing on a run that was never interrupted; a kill that
    landed is described, and the comparison starts after the checkpoint the resume started from."""
    import torch

    from sftflow.tasks.check.kill import Kill
    from sftflow.tasks.check.training import RunRecord, training_rows

    weights = {"model.w": torch.arange(6, dtype=torch.float32)}
    two = RunRecord(losses={1: 3.0, 2: 2.5, 3: 2.0}, weights=weights)
    missed = Kill(landed=False, pids=(), logged_steps=(1, 2, 3), latest=3, attempts=2)
    _, row = training_rows(two, two, RunRecord(losses={}, weights={}, kill=missed), 3, 1e-4)
    assert row.name == "kill + resume = uninterrupted" and not row.passed and row.measured == "no kill landed"
    assert row.detail.startswith("the run reached step 3 of 3 before the kill, in 2 attempts")
    landed = Kill(landed=True, pids=(11, 12, 13, 14), logged_steps=(1, 2), latest=2)
    _, row = training_rows(two, two, RunRecord(losses={3: 2.0}, weights=dict(weights), kill=landed), 3, 1e-4)
    assert row.passed and row.measured == "losses 1/1, tensors 1/1 bit-equal"
    assert row.detail == (
        "4 processes (launcher, torchrun, workers) SIGKILLed in step 3, latest step-2; "
        "resumed from the step-2 checkpoint to step 3"
    )


def test_one_check_step_leaves_nothing_to_kill_and_is_refused(tmp_path):
    result = CliRunner().invoke(app, ["check", "--work-dir", str(tmp_path), "--set", "check.steps=1"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "check.steps=1: no step after the first checkpoint" in result.output, result.output
