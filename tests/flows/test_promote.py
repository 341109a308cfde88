"""The promotion gate on Prefect's real engine: a better model is promoted, a worse one is refused with the reason, the
champion pointer only ever names a whole version, and `sft(promote=True)` ends with the gate.

Models are tiny Llamas over the demo's vocabulary: an untrained one and copies trained in this process for a few and
for more steps on the demo's train split, so "better" is measured, not assumed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sftflow.flows.config import SFTConfig
from sftflow.flows.data import sft_data
from sftflow.flows.promote import sft_promote
from sftflow.tasks.core.manifests import TrainResult
from sftflow.tasks.eval.registry import Registry

pytestmark = pytest.mark.slow

RECORDS = 160
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


def _config(work: Path, **promote) -> SFTConfig:
    return SFTConfig.model_validate(
        {
            "work_dir": str(work),
            "demo": {"records": RECORDS},
            "train": {"model": "tiny-llama", "model_overrides": TINY},
            "eval": {"max_docs": 24, "max_generations": 4},
            "promote": promote,
        }
    )


def _train_in_process(model, docs, steps: int, seed: int = 0):
    """Masked next-token loss on the docs' trained spans, AdamW, one document per step."""
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        ids, spans = docs[int(rng.integers(len(docs)))]
        ids = torch.as_tensor(np.asarray(ids), dtype=torch.long)[None]
        labels = torch.full_like(ids, -100)
        for start, end in np.asarray(spans).reshape(-1, 2):
            labels[0, start:end] = ids[0, start:end]
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from sftflow.tasks.data.index import load_index
    from sftflow.tasks.data.reader import IndexedDataset
    from sftflow.tasks.train.model import build_model

    work = tmp_path_factory.mktemp("promote")
    cfg = _config(work)
    data = sft_data(config=cfg)
    train_docs = IndexedDataset(load_index(data.index.dir), split="train")
    docs = [train_docs[i] for i in range(len(train_docs))]
    models = {}
    torch.manual_seed(0)
    model = build_model("tiny-llama", vocab_size=train_docs.vocab_size, packed=False, overrides=TINY)
    for name, steps in (("untrained", 0), ("trained", 60), ("trained_more", 240)):
        model = _train_in_process(model, docs, steps, seed=len(models))
        model.save_pretrained(work / "models" / name)
        models[name] = work / "models" / name
    return work, cfg, data, models


def _candidate(path: Path) -> TrainResult:
    return TrainResult(
        run_dir=str(path),
        steps=1,
        final_loss=None,
        trained_tokens=0,
        metrics_path="",
        checkpoint=None,
        hf_dir=str(path),
    )


def test_the_gate_promotes_better_models_and_refuses_worse_ones(setup):
    work, cfg, data, models = setup
    registry = Registry(work / "registry")

    first = sft_promote(config=cfg, data=data, train=_candidate(models["trained"]))
    assert first.decision == "promoted" and first.champion == "v0001"
    assert registry.champion().name == "v0001"
    assert (work / "registry" / "v0001" / "model" / "config.json").is_file()

    worse = sft_promote(config=cfg, data=data, train=_candidate(models["untrained"]))
    assert worse.decision == "kept" and worse.champion == "v0001"
    assert worse.metrics["candidate"].loss > worse.metrics["champion"].loss
    assert any("does not beat the champion" in r for r in worse.reasons)
    assert registry.versions() == ["v0001"]

    again = sft_promote(config=cfg, data=data, train=_candidate(models["trained"]))
    assert again.decision == "unchanged" and again.champion == "v0001"

    better = sft_promote(config=cfg, data=data, train=_candidate(models["trained_more"]))
    assert better.decision == "promoted" and better.champion == "v0002", better.reasons
    assert better.metrics["candidate"].loss < better.metrics["champion"].loss
    card = registry.champion().card
    assert card["source"]["model"] == str(models["trained_more"]) and card["eval_index_sha256"] == data.index.sha256
    history = [json.loads(line) for line in (work / "registry" / "history.jsonl").read_text().splitlines()]
    assert [h["decision"] for h in history] == ["promoted", "kept", "unchanged", "promoted"]
    assert json.loads((work / "promote.json").read_text())["champion"] == "v0002"  # the stage result


def test_a_stricter_rule_keeps_the_champion(setup):
    work, _, data, models = setup
    strict = _config(work, registry=str(work / "strict-registry"), min_improvement=0.99)
    assert sft_promote(config=strict, data=data, train=_candidate(models["trained"])).decision == "promoted"
    kept = sft_promote(config=strict, data=data, train=_candidate(models["trained_more"]))
    assert kept.decision == "kept" and kept.champion == "v0001"
    assert any("by 99.0%" in r for r in kept.reasons)


def test_the_gate_pushes_the_champion_to_a_hub_repository_and_retries_a_failed_push(setup, monkeypatch):
    """`promote.hub` against a local stand-in of the Hub's API: a push refused (bad token) leaves the local promotion
    in place and says so in the report; the next gate, though it keeps the champion, pushes it."""
    import huggingface_hub.constants

    from tests.hub_standin import HubStandIn

    work, _, data, models = setup
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the stand-in is on 127.0.0.1
    with HubStandIn("hf_good") as hub:
        hub_cfg = {"repo": "acme/sft", "endpoint": hub.url, "token_env": "SFTFLOW_TEST_HUB_TOKEN"}
        cfg = _config(work, registry=str(work / "hub-registry"), hub=hub_cfg)
        monkeypatch.setenv("SFTFLOW_TEST_HUB_TOKEN", "hf_bad")
        first = sft_promote(config=cfg, data=data, train=_candidate(models["trained"]))
        assert first.decision == "promoted" and first.champion == "v0001"
        assert not first.hub.ok and "401" in first.hub.error and hub.repos == {}
        assert "was not pushed" in Path(first.report_path).read_text()

        monkeypatch.setenv("SFTFLOW_TEST_HUB_TOKEN", "hf_good")
        kept = sft_promote(config=cfg, data=data, train=_candidate(models["untrained"]))
        assert kept.decision == "kept" and kept.hub.ok and kept.hub.version == "v0001"
        model = work / "hub-registry" / "v0001" / "model"
        repo = hub.repos["acme/sft"]
        assert repo.files("main") == {p.name: p.read_bytes() for p in model.iterdir()}
        assert repo.tags["v0001"] == kept.hub.commit
        assert f"Hub: `acme/sft` (main) holds v0001, commit [{kept.hub.commit}]" in Path(kept.report_path).read_text()
        history = (work / "hub-registry" / "history.jsonl").read_text().splitlines()
        assert [json.loads(line)["hub"]["ok"] for line in history] == [False, True]


def test_a_publish_killed_midway_leaves_the_champion_in_service(setup, monkeypatch):
    """Killed after the copy and before the rename: nothing new is visible, the champion still serves, and the next
    publish removes the leftover and takes the same version number."""
    import shutil

    from sftflow.tasks.eval import registry as registry_module

    work, _, _, models = setup
    registry = Registry(work / "kill-registry")
    with registry.lock():
        registry.set_champion(registry.publish(models["trained"], {"note": "first"}))

    real_copytree = shutil.copytree

    def copy_then_die(src, dst, **kwargs):
        real_copytree(src, dst, **kwargs)
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(registry_module.shutil, "copytree", copy_then_die)
    with pytest.raises(KeyboardInterrupt), registry.lock():
        registry.set_champion(registry.publish(models["trained_more"], {}))
    monkeypatch.undo()
    assert registry.champion().name == "v0001" and registry.versions() == ["v0001"]
    assert list((work / "kill-registry").glob(".v0002.tmp"))
    with registry.lock():
        version = registry.publish(models["trained_more"], {})
    assert version.name == "v0002" and not list((work / "kill-registry").glob(".v*.tmp"))
    assert registry.champion().name == "v0001"  # published, not yet champion: the pointer moves only when set


def test_a_pointer_naming_no_version_is_an_error_naming_the_file(tmp_path):
    (tmp_path / "champion").write_text("v0007\n")
    with pytest.raises(ValueError, match=r"champion: names 'v0007', which is not a version"):
        Registry(tmp_path).champion()
