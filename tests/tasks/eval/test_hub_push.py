"""Pushing the champion to a Hub model repository, through the real `huggingface_hub` client against a local
stand-in of the Hub's HTTP API: the branch holds exactly the champion's files, tagged with its version; a failed
push is a warning that the next gate repairs; a champion already pushed is not pushed again."""

from __future__ import annotations

import json
import logging

import pytest
from pydantic import ValidationError

from sftflow.tasks.core.manifests import HubTarget
from sftflow.tasks.eval.hub_push import STATE, sync_champion, target_key
from sftflow.tasks.eval.registry import Registry
from tests.hub_standin import HubStandIn

TOKEN = "hf_standin_write_token"


@pytest.fixture
def online(monkeypatch):
    """The tests run with HF_HUB_OFFLINE=1 (nothing may reach the real Hub); these talk to 127.0.0.1 only."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("SFTFLOW_TEST_HUB_TOKEN", TOKEN)


def _model(folder, weights: bytes, extra: str | None = None):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    (folder / "model.safetensors").write_bytes(weights)
    if extra:
        (folder / extra).write_text("only in this version\n")
    return folder


def _promote(registry: Registry, folder, loss: float):
    with registry.lock():
        version = registry.publish(folder, {"source": {"model": str(folder)}, "eval": {"loss": loss}})
        registry.set_champion(version)
    return version


def _target(hub: HubStandIn, **kw) -> HubTarget:
    return HubTarget(repo="acme/sft-champion", endpoint=hub.url, token_env="SFTFLOW_TEST_HUB_TOKEN", **kw)


def _sync(registry: Registry, target: HubTarget, caplog=None):
    """`sync_champion` under the registry's lock; with `caplog`, capturing the stage's warnings."""
    logger = logging.getLogger("sftflow.promote")  # outside a Prefect run the stage logs here
    if caplog is not None:
        logger.addHandler(caplog.handler)
    try:
        with registry.lock():
            return sync_champion(registry, target)
    finally:
        if caplog is not None:
            logger.removeHandler(caplog.handler)


def test_the_branch_holds_exactly_the_champion_tagged_with_its_version(tmp_path, online):
    registry = Registry(tmp_path / "registry")
    first = _promote(registry, _model(tmp_path / "m1", b"\x01" * 300, extra="adapter_config.json"), 1.5)
    with HubStandIn(TOKEN) as hub:
        target = _target(hub)
        pushed = _sync(registry, target)
        assert pushed.ok and pushed.version == "v0001" and pushed.commit, pushed
        repo = hub.repos["acme/sft-champion"]
        assert repo.private
        on_hub = repo.files("main")
        assert on_hub == {p.name: p.read_bytes() for p in first.model_dir.iterdir()}
        assert repo.tags["v0001"] == repo.head("main").oid == pushed.commit
        assert "eval loss: 1.5000" in repo.head("main").description
        state = json.loads((registry.root / STATE).read_text())
        assert state[target_key(target)]["version"] == "v0001"

        # Already there: no request at all.
        before = len(hub.requests)
        again = _sync(registry, target)
        assert again.ok and again.commit == pushed.commit and len(hub.requests) == before

        # A new champion replaces the files; the one only the old version had is deleted.
        second = _promote(registry, _model(tmp_path / "m2", b"\x02" * 500), 1.2)
        replaced = _sync(registry, target)
        assert replaced.ok and replaced.version == "v0002" and replaced.commit != pushed.commit
        assert repo.files("main") == {p.name: p.read_bytes() for p in second.model_dir.iterdir()}
        assert "adapter_config.json" not in repo.files("main")
        assert repo.tags == {"v0001": pushed.commit, "v0002": replaced.commit}


def test_a_registry_started_afresh_never_moves_a_published_tag(tmp_path, online, caplog):
    """A new registry numbers from v0001 again: its champion reaches the branch, but the tag v0001 keeps naming the
    commit whoever pinned it got, with a warning, and the push records the commit as untagged."""
    with HubStandIn(TOKEN) as hub:
        target = _target(hub)
        old = Registry(tmp_path / "old-registry")
        _promote(old, _model(tmp_path / "m1", b"\x01" * 300), 1.5)
        first = _sync(old, target)
        assert first.ok and first.tag == "v0001"
        fresh = Registry(tmp_path / "new-registry")
        second_model = _promote(fresh, _model(tmp_path / "m2", b"\x02" * 400), 1.1)
        assert second_model.name == "v0001"
        second = _sync(fresh, target, caplog)
        repo = hub.repos["acme/sft-champion"]
        assert second.ok and second.commit == repo.head("main").oid != first.commit
        assert repo.files("main") == {p.name: p.read_bytes() for p in second_model.model_dir.iterdir()}
        assert repo.tags == {"v0001": first.commit}  # not moved
        assert second.tag is None
        assert "tag v0001 in acme/sft-champion already names commit" in caplog.text
        # Recorded as pushed: the next gate with the same champion sends nothing and still reports it untagged.
        before = len(hub.requests)
        again = _sync(fresh, target)
        assert again.ok and again.tag is None and len(hub.requests) == before


def test_a_failed_push_is_a_warning_and_the_next_sync_pushes_the_champion(tmp_path, online, monkeypatch, caplog):
    registry = Registry(tmp_path / "registry")
    _promote(registry, _model(tmp_path / "m1", b"\x01" * 64), 2.0)
    with HubStandIn(TOKEN) as hub:
        target = _target(hub)
        monkeypatch.setenv("SFTFLOW_TEST_HUB_TOKEN", "hf_wrong_token")
        failed = _sync(registry, target, caplog)
        assert not failed.ok and failed.version == "v0001" and "401" in failed.error, failed
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("v0001 was not pushed to" in w and "acme/sft-champion" in w for w in warnings), warnings
        assert registry.champion().name == "v0001"  # the local promotion stands
        assert not (registry.root / STATE).exists() and hub.repos == {}

        monkeypatch.setenv("SFTFLOW_TEST_HUB_TOKEN", TOKEN)
        retried = _sync(registry, target)
        assert retried.ok and hub.repos["acme/sft-champion"].tags["v0001"] == retried.commit


def test_an_unreachable_hub_fails_fast_as_a_warning(tmp_path, online):
    registry = Registry(tmp_path / "registry")
    _promote(registry, _model(tmp_path / "m1", b"\x01" * 64), 2.0)
    with HubStandIn(TOKEN) as hub:
        url = hub.url
    pushed = _sync(registry, HubTarget(repo="acme/x", endpoint=url, token_env="SFTFLOW_TEST_HUB_TOKEN"))
    assert not pushed.ok and pushed.error


def test_offline_mode_is_a_warning_naming_it(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    registry = Registry(tmp_path / "registry")
    _promote(registry, _model(tmp_path / "m1", b"\x01" * 64), 2.0)
    pushed = _sync(registry, HubTarget(repo="acme/x", endpoint="http://127.0.0.1:9"))
    assert not pushed.ok and "HF_HUB_OFFLINE" in pushed.error


def test_a_branch_other_than_main_is_created_and_main_is_left_alone(tmp_path, online):
    registry = Registry(tmp_path / "registry")
    version = _promote(registry, _model(tmp_path / "m1", b"\x03" * 64), 2.0)
    with HubStandIn(TOKEN) as hub:
        pushed = _sync(registry, _target(hub, revision="staging", private=False))
        repo = hub.repos["acme/sft-champion"]
        assert pushed.ok and not repo.private and repo.files("main") == {}
        assert repo.files("staging") == {p.name: p.read_bytes() for p in version.model_dir.iterdir()}
        assert repo.tags == {"staging-v0001": pushed.commit}  # tags are per repository: the branch is in the name


def test_no_champion_pushes_nothing_and_a_repo_must_be_owner_and_name(tmp_path):
    assert sync_champion(Registry(tmp_path / "empty"), HubTarget(repo="a/b")) is None
    with pytest.raises(ValidationError, match="owner/name"):
        HubTarget(repo="no-owner")


def test_the_gate_report_says_when_the_champion_went_untagged():
    from sftflow.tasks.core.manifests import HubPush, PromoteResult
    from sftflow.tasks.eval.promotion import report_markdown

    hub = HubPush(ok=True, repo="acme/x", revision="main", version="v0001", commit="c0ffee", url="u", tag="v0001")
    result = PromoteResult(
        decision="promoted", reasons=[], champion="v0001", candidate_sha256="s", metrics={}, report_path="r", hub=hub
    )
    assert "holds v0001, commit [c0ffee](u)\n" in report_markdown(result, "candidate", None)
    untagged = result.model_copy(update={"hub": hub.model_copy(update={"tag": None})})
    assert "commit [c0ffee](u); untagged: its version's tag already names another commit" in report_markdown(
        untagged, "candidate", None
    )
