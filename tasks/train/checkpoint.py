"""DCP checkpoints of Stateful components: `model`, `optimizer`, `lr_scheduler`, `progress`.

Layout of `RUN_DIR/checkpoints/`::

    step-4/      a torch.distributed.checkpoint folder (.metadata + files of ~1 GiB) and CHECKSUMS (sha256 per file,
                 checked before the checkpoint is loaded: `sftflow.tasks.train.checksums`)
    step-8/
    latest       the text "step-8", written (atomically) only after step-8/ is complete on every rank

Model and optimizer state go through `torch.distributed.checkpoint.state_dict` (`get_model_state_dict` and friends),
keyed by the Hugging Face parameter names, so a checkpoint saved by N ranks loads on M ranks (DCP reshards) and into a
plain single-process model (`load_model_weights`).

Resume loads every component from `latest`. `init_from` loads only the named components from another run's
checkpoint: by default just `model`, i.e. a new fine-tune that starts from those weights with a fresh optimizer,
schedule and step counter.
"""

from __future__ import annotations

import inspect
import logging
import math
import queue
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from sftflow.tasks.core.atomic import write_atomic
from sftflow.tasks.core.disk_full import DiskFull, as_disk_full
from sftflow.tasks.core.leftovers import remove
from sftflow.tasks.train.checksums import verify_checksums, write_checksums
from sftflow.tasks.train.config import COMPONENTS, CheckpointConfig
from sftflow.tasks.train.deferred import DeferredLoadPlanner, DeferredSavePlanner

log = logging.getLogger(__name__)

LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class ModelState(Stateful):
    """The model's parameters under their Hugging Face names; with `trained_only` (a LoRA run) just the trained ones
    (the adapters): the frozen base comes from its own checkpoint, not from the run's."""

    def __init__(self, model: nn.Module, trained_only: bool = False):
        self.model = model
        self.options = StateDictOptions(ignore_frozen_params=trained_only, strict=not trained_only)
        # `ignore_frozen_params` still lets a tied head through under its second name: filter by the trained names.
        self.trained = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        self.trained_only = trained_only

    def state_dict(self):
        state = get_model_state_dict(self.model, options=self.options)
        return {k: v for k, v in state.items() if k in self.trained} if self.trained_only else state

    def load_state_dict(self, state_dict):
        set_model_state_dict(self.model, state_dict, options=self.options)

    def full_tensor(self, name: str) -> torch.Tensor:
        """One whole parameter or buffer, on this rank's device (export, a tensor at a time); gathering a sharded
        parameter is a collective: call it on every rank, for the same names in the same order."""
        return full_tensor(self.model, name)


class OptimizerState(Stateful):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict):
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class SchedulerState(Stateful):
    """An LR scheduler's counters (the lambdas are code, rebuilt from config)."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler):
        self.scheduler = scheduler

    def state_dict(self):
        return {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}

    def load_state_dict(self, state_dict):
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), **state_dict})
        for group, lr in zip(self.scheduler.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
            group["lr"] = lr


@dataclass
class Progress(Stateful):
    """Where training stands: completed optimizer steps, epoch, tokens seen, and the CPU RNG.

    Every rank seeds the same generator and training draws no per-rank randomness (no dropout), so one RNG state
    serves all ranks and survives a change of world size.
    """

    step: int = 0
    epoch: int = 0
    tokens_seen: int = 0
    trained_tokens_seen: int = 0
    rng: torch.Tensor = field(default_factory=torch.get_rng_state)

    def state_dict(self):
        return {
            "step": torch.tensor(self.step),
            "epoch": torch.tensor(self.epoch),
            "tokens_seen": torch.tensor(self.tokens_seen),
            "trained_tokens_seen": torch.tensor(self.trained_tokens_seen),
            "rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state_dict):
        self.step = int(state_dict["step"])
        self.epoch = int(state_dict["epoch"])
        self.tokens_seen = int(state_dict["tokens_seen"])
        self.trained_tokens_seen = int(state_dict["trained_tokens_seen"])
        self.rng = state_dict["rng"]
        torch.set_rng_state(self.rng)


def step_dir(folder: Path, step: int) -> Path:
    return folder / f"step-{step}"


def latest_checkpoint(folder: Path) -> Path | None:
    """The checkpoint named by `folder/latest`, or None when no save has completed."""
    marker = folder / LATEST
    if not marker.is_file():
        return None
    path = folder / marker.read_text().strip()
    if not (path / ".metadata").is_file():
        raise ValueError(f"{marker}: names {path.name}, which is not a complete checkpoint (no .metadata)")
    return path


def resolve_checkpoint(path: Path) -> Path:
    """A `step-N` folder as given, or the latest checkpoint of a run dir / checkpoints folder."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    for folder in (path, path / "checkpoints"):
        found = latest_checkpoint(folder)
        if found is not None:
            return found
    raise ValueError(f"init_from={path}: not a DCP checkpoint folder (no .metadata) nor a run with a 'latest' marker")


def restores_model(config: CheckpointConfig) -> bool:
    """Whether `Checkpointer.restore` will load the `model` component (a resume, or `init_from` with `model`)."""
    if config.resume and latest_checkpoint(config.folder) is not None:
        return True
    return config.init_from is not None and "model" in config.load_components


def checkpoint_to_load(config: CheckpointConfig) -> Path | None:
    """The checkpoint `Checkpointer.restore` will load: the run's `latest` when resuming, else `init_from`'s."""
    latest = latest_checkpoint(config.folder)
    if latest is not None:
        return latest if config.resume else None
    return resolve_checkpoint(config.init_from) if config.init_from is not None else None


def checkpoint_components(path: Path) -> set[str]:
    """Top-level components stored in a DCP checkpoint, read from its metadata (no tensor is loaded)."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


def check_components(path: Path, wanted: tuple[str, ...]) -> None:
    unknown = [c for c in wanted if c not in COMPONENTS]
    if unknown:
        raise ValueError(f"load_components: unknown component(s) {unknown}; expected a subset of {list(COMPONENTS)}")
    present = checkpoint_components(path)
    missing = [c for c in wanted if c not in present]
    if missing:
        raise ValueError(
            f"checkpoint {path} has no {missing} (it holds {sorted(present)}); drop them from load_components"
        )


class Checkpointer:
    """Saves and restores the components of one run."""

    def __init__(self, config: CheckpointConfig, states: dict[str, Stateful], *, is_main: bool):
        assert set(states) == set(COMPONENTS), sorted(states)
        self.config = config
        self.states = states
        self.is_main = is_main
        self.last_saved_step: int | None = None

    def restore(self) -> str:
        """Resume from `latest` (all components) or initialise from `init_from` (the chosen ones). Says what it did."""
        latest = latest_checkpoint(self.config.folder)
        if latest is not None:
            if not self.config.resume:
                raise ValueError(f"{self.config.folder} already holds checkpoints; pass resume to continue that run")
            dcp.load(dict(self.states), checkpoint_id=str(latest), planner=DeferredLoadPlanner())
            self.last_saved_step = int(_STEP_DIR.match(latest.name).group(1))
            return f"resumed all components from {latest}"
        if self.config.init_from is not None:
            path = resolve_checkpoint(self.config.init_from)
            check_components(path, self.config.load_components)
            wanted = {c: self.states[c] for c in self.config.load_components}
            dcp.load(wanted, checkpoint_id=str(path), planner=DeferredLoadPlanner())
            return f"initialised {list(self.config.load_components)} from {path}"
        return "fresh start"

    def due(self, step: int, last: bool = False) -> bool:
        """Whether to save now, after `step` and with its totals in the progress: every `every` steps, and after the
        `last` step unless that one is saved."""
        if last:
            return self.config.enabled and self.last_saved_step != step
        return self._periodic(step)

    def will_save(self, step: int) -> bool:
        """Asked ahead, before `step`'s totals are read: whether `due(step)` will save, so that a loop queueing steps
        ahead finishes `step` before it queues the next (a checkpoint then holds its own step's weights and
        progress). Kept apart from `due`, which is only ever asked once a step is complete."""
        return self._periodic(step)

    def _periodic(self, step: int) -> bool:
        return self.config.enabled and self.config.every > 0 and step % self.config.every == 0

    def save(self, step: int) -> Path:
        """Save every component as `step-<step>`; then (rank 0) point `latest` at it and prune old checkpoints."""
        path = step_dir(self.config.folder, step)
        if self.is_main and (path.exists() or path.is_symlink()):
            remove(path)  # a partial save left by a crash at this very step
        dist.barrier()
        try:
            dcp.save(dict(self.states), storage_writer=storage_writer(path), planner=DeferredSavePlanner())
            dist.barrier()  # every rank's shard is written before it is hashed and `latest` moves
            write_checksums(path)
            if self.is_main:
                write_atomic(self.config.folder / LATEST, path.name)
        except BaseException as err:  # noqa: B036 - re-raised unless it is a full disk
            # DCP reports a rank's failed write as a CheckpointException (a BaseException) around the write's error;
            # a full disk under it is told as one line (the partial folder is replaced by the next save of the step)
            doing = f"while writing checkpoint {path.name}"
            full = as_disk_full(err, path, doing) or _out_of_room(err, path, doing)
            if full is None:
                raise
            raise full from err
        if self.is_main:
            prune_checkpoints(self.config.folder, self.config.keep_last, step)
        self.last_saved_step = step
        return path


# Free bytes below which a save that failed without naming its cause is taken for a full disk.
FULL_DISK_MARGIN = 64 << 20


def _out_of_room(err: BaseException, path: Path, doing: str) -> DiskFull | None:
    """A save whose write came up short on a filesystem with (next to) no room left. torch's zip writer reports a
    short write as `RuntimeError: [enforce fail at inline_container.cc] . unexpected pos` without the OS's error,
    so the free space is what tells a full disk from another failure."""
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        return None
    return DiskFull(path, doing) if "unexpected pos" in str(err) and free < FULL_DISK_MARGIN else None


# Bytes of tensor data per checkpoint file: what DCP's writer holds on the host at once while it writes one.
FILE_BYTES = 1 << 30


class BoundedFileWriter(dcp.FileSystemWriter):
    """DCP's file writer with files of at most `file_bytes` of tensor data (a larger tensor gets a file of its own).

    DCP's writer keeps every tensor it has written to a file until the file is closed (its `tensor_dict`, filled for
    every format), so with its default, one file per rank, a save holds a rank's whole state on the host (fp32
    weights and moments, 12 bytes a parameter: 90 GiB for an 8B model on one GPU); with a file per tensor it holds one
    tensor, but an 8B's state becomes ~1,200 files per rank, slow to create and list on network filesystems. Bounded
    files hold at most `file_bytes` plus the largest tensor, in ~1 GiB files. Items keep the planner's order, so the
    deferred entries of one file are made one after another as the writer reaches them."""

    def __init__(self, path: str | Path, file_bytes: int = FILE_BYTES):
        super().__init__(str(path), single_file_per_rank=False)
        self.file_bytes = file_bytes

    def write_data(self, plan, planner):
        write_files = getattr(self, "_write_data", None)
        if write_files is None or list(inspect.signature(write_files).parameters) != ["planner", "file_queue"]:
            return super().write_data(plan, planner)  # a torch without this queue-based writer: a file per tensor
        file_queue: queue.Queue = queue.Queue()
        for number, items in enumerate(bounded_groups(plan.items, self.file_bytes)):
            name = f"{plan.storage_data.prefix}{number}{DEFAULT_SUFFIX}"
            file_queue.put((self.fs.concat_path(self.path, name), name, items))
        return write_files(planner, file_queue)


def bounded_groups(items: list, file_bytes: int) -> list[list]:
    """`items` in order, cut into runs whose tensor data adds up to at most `file_bytes` (or one larger tensor)."""
    groups: list[list] = []
    size = 0
    for item in items:
        nbytes = item_bytes(item)
        if not groups or size + nbytes > file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += nbytes
    return groups


def item_bytes(item) -> int:
    """Bytes of one write item's data on this rank: its chunk of the tensor (a shard's chunk, not the whole)."""
    if item.tensor_data is None:
        return item.bytes_io_data.nbytes if item.bytes_io_data is not None else 0
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def storage_writer(path: Path, file_bytes: int = FILE_BYTES) -> BoundedFileWriter:
    """The checkpoints' writer: files of at most `file_bytes` of tensor data (`BoundedFileWriter`)."""
    return BoundedFileWriter(path, file_bytes)


def prune_checkpoints(folder: Path, keep_last: int, current: int) -> list[int]:
    """After saving step `current`: keep the newest `keep_last` complete checkpoints up to it, remove older ones and
    partial saves (no `.metadata`) below it. Returns the steps removed.

    Folders above `current` are left alone: one is a partial save of an earlier attempt that got further before it
    was killed, and must not count as one of the checkpoints to keep (it would push out the one `latest` names);
    `save` replaces it when training reaches its step."""
    complete, partial = [], []
    for path in folder.iterdir():
        match = _STEP_DIR.match(path.name)
        if path.is_dir() and match and int(match.group(1)) <= current:
            (complete if (path / ".metadata").is_file() else partial).append(int(match.group(1)))
    removed = sorted(complete)[:-keep_last] + [s for s in partial if s != current]
    for old in removed:
        remove(step_dir(folder, old))  # a linked step folder loses its link; what it points to stays
    return sorted(removed)


def load_model_weights(path: str | Path, model: nn.Module, trust_unverified: bool = False) -> None:
    """Load the `model` component of a DCP checkpoint into a plain (unsharded, single-process) HF model."""
    path = resolve_checkpoint(Path(path))
    verify_checksums(path, trust_unverified)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    model.load_state_dict(state["model"])


def full_tensor(model: nn.Module, name: str) -> torch.Tensor:
    """`model`'s parameter or buffer `name`, whole: a DTensor shard gathered from every rank."""
    from torch.distributed.tensor import DTensor

    try:
        tensor = model.get_parameter(name)
    except AttributeError:
        tensor = model.get_buffer(name)
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
