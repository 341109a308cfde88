"""Deferred checkpoint entries: made when DCP's writer reaches them, handed over when read, one at a time."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp

from sftflow.tasks.train.checkpoint import storage_writer
from sftflow.tasks.train.deferred import DeferredLoadPlanner, DeferredSavePlanner, deferred, deferred_of

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no_dist=True, on purpose

SHAPES = [(64, 32), (128,), (16, 16), (3, 5, 7)]


class Entries:
    """Four deferred fp32 entries whose values are made on demand (and counted while alive), and read back."""

    def __init__(self, seed: int):
        self.values = [torch.randn(s, generator=torch.Generator().manual_seed(seed + i)) for i, s in enumerate(SHAPES)]
        self.made = [0] * len(SHAPES)
        self.alive = 0
        self.most_alive = 0
        self.consumed: dict[int, torch.Tensor] = {}

    def _produce(self, i: int) -> torch.Tensor:
        self.made[i] += 1
        value = self.values[i].clone()  # a new tensor, as a joined master is
        self.alive += 1
        self.most_alive = max(self.most_alive, self.alive)
        weakref.finalize(value.untyped_storage(), self._freed)  # the writer holds detached views of it
        return value

    def _freed(self) -> None:
        self.alive -= 1

    def state(self) -> dict[str, torch.Tensor]:
        def entry(i: int) -> torch.Tensor:
            return deferred(
                torch.Size(SHAPES[i]), torch.float32, lambda: self._produce(i), lambda v: self.consumed.setdefault(i, v)
            )

        return {f"w{i}": entry(i) for i in range(len(SHAPES))}


def test_each_entry_is_made_when_written_and_handed_over_when_read(tmp_path):
    saved = Entries(seed=0)
    plain = torch.arange(10.0)
    state = {"model": saved.state(), "other": {"plain": plain}}
    assert saved.made == [0, 0, 0, 0]  # placeholders: nothing made yet
    writer = storage_writer(tmp_path, file_bytes=0)  # a file per tensor
    dcp.save(state, storage_writer=writer, planner=DeferredSavePlanner(), no_dist=True)
    assert saved.made == [1, 1, 1, 1]
    # the writer lets go of each file's tensors when it closes the file, before the next is made but one (the loop's
    # last value)
    assert saved.most_alive <= 2

    loaded = Entries(seed=100)
    into = {"model": loaded.state(), "other": {"plain": torch.zeros(10)}}
    dcp.load(into, checkpoint_id=str(tmp_path), planner=DeferredLoadPlanner(), no_dist=True)
    assert loaded.made == [0, 0, 0, 0]  # loading makes nothing: it hands over what it read
    assert sorted(loaded.consumed) == [0, 1, 2, 3]
    for i, want in enumerate(saved.values):
        assert torch.equal(loaded.consumed[i], want), i
    assert torch.equal(into["other"]["plain"], plain)  # every other entry loads in place, as DCP does


def test_bounded_files_hold_one_file_of_entries_at_a_time(tmp_path):
    """Files of at most `file_bytes` of tensor data, in the planner's order; a larger tensor gets its own file."""
    saved = Entries(seed=0)  # 8192, 512, 1024 and 420 bytes
    writer = storage_writer(tmp_path, file_bytes=1600)
    dcp.save({"model": saved.state()}, storage_writer=writer, planner=DeferredSavePlanner(), no_dist=True)
    assert len(list(tmp_path.glob("*.distcp"))) == 3
    metadata = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    files = {index.fqn: info.relative_path for index, info in metadata.storage_data.items()}
    groups = sorted(sorted(k for k in files if files[k] == f) for f in set(files.values()))
    assert groups == [["model.w0"], ["model.w1", "model.w2"], ["model.w3"]]  # 8192 | 512 + 1024 | 420 bytes
    assert saved.most_alive <= 3  # one file's two, and the one before

    loaded = Entries(seed=100)
    dcp.load({"model": loaded.state()}, checkpoint_id=str(tmp_path), planner=DeferredLoadPlanner(), no_dist=True)
    for i, want in enumerate(saved.values):
        assert torch.equal(loaded.consumed[i], want), i


def test_a_torch_whose_queue_writer_differs_gets_a_file_per_tensor(tmp_path):
    """The bounded files go through DCP's private queue writer; where it is missing or takes other arguments, the
    writer falls back to DCP's own file per tensor instead of calling it wrongly."""
    writer = storage_writer(tmp_path, file_bytes=1 << 30)
    original = writer._write_data
    # Another signature; DCP's own write_data (the fallback) still reaches the original through it on this torch.
    writer._write_data = lambda planner, file_queue, extra=None: original(planner, file_queue)
    state = {"a": torch.randn(10), "b": torch.randn(20)}
    dcp.save(state, storage_writer=writer, no_dist=True)
    assert len(list(tmp_path.glob("*.distcp"))) == 2
    into = {"a": torch.zeros(10), "b": torch.zeros(20)}
    dcp.load(into, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(into["a"], state["a"]) and torch.equal(into["b"], state["b"])


def test_the_default_file_size_puts_a_small_state_in_one_file(tmp_path):
    state = {"a": torch.randn(100, 100), "b": torch.arange(10), "step": 3}
    dcp.save(state, storage_writer=storage_writer(tmp_path), no_dist=True)
    assert len(list(tmp_path.glob("*.distcp"))) == 1
    into = {"a": torch.zeros(100, 100), "b": torch.zeros(10, dtype=torch.int64), "step": 0}
    dcp.load(into, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(into["a"], state["a"]) and torch.equal(into["b"], state["b"]) and into["step"] == 3


def test_the_default_writer_would_hold_every_entry_until_its_file_closes(tmp_path):
    """Why the checkpointer writes a file per tensor: DCP's default (one file per rank) keeps them all."""
    saved = Entries(seed=0)
    dcp.save({"model": saved.state()}, checkpoint_id=str(tmp_path), planner=DeferredSavePlanner(), no_dist=True)
    assert saved.most_alive == len(SHAPES)


def test_placeholders_fail_loudly_outside_the_deferred_planners(tmp_path):
    entry = deferred(torch.Size((4, 4)), torch.float32, lambda: torch.ones(4, 4), lambda v: None)
    assert deferred_of(entry) is not None and deferred_of(torch.ones(1)) is None
    assert entry.untyped_storage().nbytes() == 4  # one element, whatever the shape
    dcp.save({"w": entry}, checkpoint_id=str(tmp_path / "default"), no_dist=True)  # the default planner
    plain = {"w": torch.zeros(4, 4)}
    dcp.load(plain, checkpoint_id=str(tmp_path / "default"), no_dist=True)
    assert plain["w"].isnan().all()  # it wrote the placeholder: NaN, not plausible weights
    dcp.save({"w": torch.ones(4, 4)}, checkpoint_id=str(tmp_path / "real"), no_dist=True)
    # the default planner copies into the placeholder, whose elements share one element of memory
    with pytest.raises(BaseException, match="refers to a single memory location"):
        dcp.load({"w": entry}, checkpoint_id=str(tmp_path / "real"), no_dist=True)
