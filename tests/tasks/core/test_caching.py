"""Content-derived cache keys and output validation (the engine-level behaviour is in tests/flows)."""

from __future__ import annotations

from sftflow.tasks.core.caching import outputs_valid, stage_key, write_checksums
from sftflow.tasks.core.manifests import PbinShard

ENTRIES = ("sftflow.tasks.core.caching",)


def _shard(sha: str) -> PbinShard:
    return PbinShard(
        path="/x.pbin", sha256=sha, format_version=1, num_docs=1, num_tokens=2, num_loss_tokens=1, vocab_size=9,
        token_dtype="uint16",
    )  # fmt: skip


def test_key_follows_content_not_run_details():
    base = {"shard": _shard("a" * 64), "config": {"lr": 1e-3}, "work_dir": "w"}
    key = stage_key("train", "1", ENTRIES, base)
    assert key == stage_key("train", "1", ENTRIES, {**base, "timeout_s": 60, "node_rank": 1})
    assert key == stage_key("train", "1", ENTRIES, {**base, "live_track": object()})  # another tracker, same model
    assert key != stage_key("train", "1", ENTRIES, {**base, "shard": _shard("b" * 64)})
    assert key != stage_key("train", "1", ENTRIES, {**base, "config": {"lr": 2e-3}})
    assert key != stage_key("train", "2", ENTRIES, base)  # a format version bump
    assert key != stage_key("plan", "1", ENTRIES, base)  # equal inputs, another stage: unlike plain INPUTS


def test_a_typed_model_keys_as_its_dump_and_without_its_run_details():
    from sftflow.tasks.data.stage import TokenizerRef
    from sftflow.tasks.train.config import TrainOptions

    tokenizer = TokenizerRef(path="/tok", sha256="c" * 64)

    def key(options: TrainOptions) -> str:
        return stage_key("train", "1", ENTRIES, {"options": options, "tokenizer": tokenizer, "work_dir": "w"})

    options = TrainOptions(optimizer=dict(lr=1e-3))
    dumped = {"options": options.model_dump(mode="json"), "tokenizer": {"path": "/tok", "sha256": "c" * 64}}
    assert key(options) == stage_key("train", "1", ENTRIES, {**dumped, "work_dir": "w"})
    # The nodes of one multi-node run, and a different time limit, share the run folder.
    two_nodes = options.model_copy(update={"nnodes": 2})
    assert key(two_nodes.model_copy(update={"node_rank": 1, "timeout_s": 60.0})) == key(two_nodes)
    assert key(options) != key(TrainOptions(optimizer=dict(lr=2e-3)))


def test_outputs_valid_detects_missing_and_changed_files(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "big.distcp").write_bytes(b"not listed")
    assert not outputs_valid(tmp_path)  # nothing listed yet: an incomplete output
    write_checksums(tmp_path, include=("hf",))
    assert outputs_valid(tmp_path)
    (tmp_path / "checkpoints" / "big.distcp").write_bytes(b"changed, but not part of the checked output")
    assert outputs_valid(tmp_path)
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"tampered")
    assert not outputs_valid(tmp_path)
    write_checksums(tmp_path)
    (tmp_path / "hf" / "model.safetensors").unlink()
    assert not outputs_valid(tmp_path)


def test_the_train_stage_runs_no_tracking_code():
    """Live tracking reaches training as an object (`train(live=...)`), so editing the tracking code retrains
    nothing: no tracking module is in the train stage's code fingerprint."""
    from sftflow.tasks.core.code_closure import import_closure
    from sftflow.tasks.train.stage import TRAIN_CACHE

    assert not [m for m in import_closure(TRAIN_CACHE.entries) if m.startswith("sftflow.tasks.track")]
