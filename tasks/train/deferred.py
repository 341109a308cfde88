"""Checkpoint entries made when the writer reaches them and handed over when their bytes are read.

A `Stateful` whose tensors do not exist as such (the one-device path's fp32 masters are joined from the bf16 weights
and their low bits) names each one by a placeholder carrying its shape, its dtype and two functions: `produce` gives
the current value (save), `consume` takes a loaded one (load). `DeferredSavePlanner` and `DeferredLoadPlanner` are
DCP's default planners plus those two calls, so a save or a load holds one such tensor at a time on the host instead
of the whole component (32 GB of fp32 masters for an 8B model). Every other entry goes through DCP unchanged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

_ATTRIBUTE = "_sftflow_deferred"


@dataclass(frozen=True)
class Deferred:
    produce: Callable[[], torch.Tensor]  # the entry's value now, on any device
    consume: Callable[[torch.Tensor], None]  # takes the value a load read (a CPU tensor of the placeholder's dtype)


def deferred(shape: torch.Size, dtype: torch.dtype, produce, consume) -> torch.Tensor:
    """A placeholder for one entry: one element of storage viewed at `shape`. Its value is NaN so that a save through
    DCP's default planner (which writes the placeholder itself) leaves unmistakable values, and a load into it through
    the default planner fails (DCP cannot copy into a tensor whose elements share memory)."""
    fill = float("nan") if dtype.is_floating_point else 0
    placeholder = torch.full((), fill, dtype=dtype).expand(shape)
    setattr(placeholder, _ATTRIBUTE, Deferred(produce, consume))
    return placeholder


def deferred_of(value) -> Deferred | None:
    return getattr(value, _ATTRIBUTE, None) if isinstance(value, torch.Tensor) else None


class DeferredSavePlanner(DefaultSavePlanner):
    """The default save plan (made from the placeholders' shapes and dtypes); a deferred entry's value is produced
    when the storage writer asks for it, and dropped once written."""

    def lookup_object(self, index):
        value = super().lookup_object(index)
        entry = deferred_of(value)
        return value if entry is None else entry.produce()


class DeferredLoadPlanner(DefaultLoadPlanner):
    """The default load plan; a deferred entry is read into a CPU buffer of its own, consumed when its last chunk has
    arrived (a checkpoint saved by N ranks holds a tensor in up to N chunks) and released."""

    def finish_plan(self, new_plan):
        plan = super().finish_plan(new_plan)
        self._chunks_left = Counter(
            item.dest_index.fqn
            for item in plan.items
            if deferred_of(self.state_dict.get(item.dest_index.fqn)) is not None
        )
        self._buffers: dict[str, torch.Tensor] = {}
        return plan

    def resolve_tensor(self, read_item):
        fqn = read_item.dest_index.fqn
        placeholder = self.lookup_tensor(read_item.dest_index)
        if deferred_of(placeholder) is None:
            return super().resolve_tensor(read_item)
        buffer = self._buffers.get(fqn)
        if buffer is None:
            buffer = self._buffers[fqn] = torch.empty(placeholder.shape, dtype=placeholder.dtype)
        return self.transform_tensor(read_item, buffer)

    def commit_tensor(self, read_item, tensor) -> None:
        fqn = read_item.dest_index.fqn
        if fqn in self._buffers:
            self._chunks_left[fqn] -= 1
            if self._chunks_left[fqn] == 0:
                deferred_of(self.state_dict[fqn]).consume(self._buffers.pop(fqn))
            return
        super().commit_tensor(read_item, tensor)
