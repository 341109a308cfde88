"""A damaged checkpoint's error says what can be done about it, from what its folder holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from sftflow.tasks.train.checksums import verify_checksums, write_checksums


def _checkpoint(folder: Path, step: int) -> Path:
    path = folder / f"step-{step}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"metadata")
    (path / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    write_checksums(path)
    return path


def _damage(path: Path) -> None:
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))


def test_with_keep_last_1_the_error_does_not_offer_an_earlier_checkpoint(tmp_path):
    only = _checkpoint(tmp_path / "checkpoints", 6)
    _damage(only)
    with pytest.raises(ValueError) as err:
        verify_checksums(only, resuming=True)
    message = str(err.value)
    assert message.startswith(f"checkpoint {only} is damaged: {only / '__0_0.distcp'} does not match its sha256")
    assert "earlier checkpoint," not in message and "resume from an earlier" not in message
    assert f"no earlier checkpoint is kept in {tmp_path / 'checkpoints'}" in message
    assert "train it again from step 0" in message


def test_an_earlier_checkpoint_is_named_with_the_way_to_resume_from_it(tmp_path):
    folder = tmp_path / "checkpoints"
    _checkpoint(folder, 3)
    _checkpoint(folder, 9)  # newer than the damaged one: not a way back
    damaged = _checkpoint(folder, 6)
    _damage(damaged)
    with pytest.raises(ValueError, match=rf"write 'step-3' into {folder / 'latest'}$"):
        verify_checksums(damaged, resuming=True)
    with pytest.raises(ValueError, match=rf"load {folder / 'step-3'}, the newest earlier checkpoint, instead$"):
        verify_checksums(damaged)  # init_from: another run's checkpoint is not ours to rewrite `latest` of
