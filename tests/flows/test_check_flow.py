"""The `sft-check` flow on Prefect's engine: it returns the report and publishes the table when every check passes,
and ends Failed, with the table, when one fails, so a deployment can gate training on it."""

from __future__ import annotations

import json

from sftflow.flows.check import ChecksFailed, sft_check
from sftflow.flows.config import SFTConfig
from tests.flows.test_train_resume import _artifact_keys
from tests.tasks.check.test_check import STOP_OUTSIDE
from tests.tasks.data.test_spans import CONVERSATIONS
from tests.tasks.family_configs import save_family_model


def test_sft_check_completes_with_its_table_and_fails_on_a_failed_check(tmp_path, tiny_tokenizer_dir):
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(CONVERSATIONS[n]) + "\n" for n in ("multi_turn", "unicode")))
    model = save_family_model("qwen3", 400, tmp_path / "model")
    raw = {
        "work_dir": str(tmp_path / "work"),
        "data": {"sources": [str(source)], "tokenizer": str(tiny_tokenizer_dir)},
        "train": {"model": str(model)},
        "check": {"device": "cpu", "steps": 0},
    }
    state = sft_check(config=SFTConfig.model_validate(raw), return_state=True)
    assert state.is_completed()
    report = state.result()
    assert report.passed and len(report.rows) == 4
    assert "sft-check" in _artifact_keys(state)

    (tmp_path / "stop_outside.jinja").write_text(STOP_OUTSIDE)
    raw["data"]["render"] = {"template": str(tmp_path / "stop_outside.jinja")}
    state = sft_check(config=SFTConfig.model_validate(raw), return_state=True)
    assert state.is_failed()
    try:
        state.result()
    except ChecksFailed as err:
        (row,) = [line for line in str(err).splitlines() if line.startswith("one stop per trained turn")]
        assert row.split()[5:7] == ["FAIL", "0/4"], row
    else:
        raise AssertionError("a failed check did not fail the flow run")


def test_sft_with_check_before_train_stops_at_a_failed_check(tmp_path, tiny_tokenizer_dir):
    """`check.before_train` runs the checks as the `sft` flow's first step: a failed one fails the run before the
    data stage writes anything."""
    from sftflow.flows.sft import sft

    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(CONVERSATIONS[n]) + "\n" for n in ("multi_turn", "unicode")))
    (tmp_path / "stop_outside.jinja").write_text(STOP_OUTSIDE)
    raw = {
        "work_dir": str(tmp_path / "work"),
        "data": {
            "sources": [str(source)],
            "tokenizer": str(tiny_tokenizer_dir),
            "render": {"template": str(tmp_path / "stop_outside.jinja")},
        },
        "train": {"model": str(save_family_model("qwen3", 400, tmp_path / "model"))},
        "check": {"device": "cpu", "steps": 0, "before_train": True},
    }
    state = sft(config=SFTConfig.model_validate(raw), return_state=True)
    assert state.is_failed()
    try:
        state.result()
    except ChecksFailed as err:
        assert "one stop per trained turn" in str(err)
    else:
        raise AssertionError("a failed check did not fail the sft run")
    assert not (tmp_path / "work" / "data.json").exists()
