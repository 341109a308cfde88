"""AdamW moments in pinned host memory, brought through the GPU for their step: the one-device path's optimizer
state offload.

On one GPU the moments are 8 of the 12–14 bytes a trained parameter takes (an 8B model: 60 GiB). Offloaded, they
live in host memory; each unit of parameters (a decoder layer, or the embeddings, final norm or head) is copied into
a device slot before its step and back after it, on two side streams, so the copies overlap compute: with the
optimizer stepping in the backward, a layer's moments come in while the layers after it compute their gradients, and
go back while the layers before it do. After the backward, the step brings one unit in while it steps the one before.
The price is 16 bytes a parameter over the host link each step (8 in, 8 out), and two slots of the largest unit's
moments on the device.

Correctness does not rest on the order the units come in: a unit whose moments are not on the device when its first
parameter steps is brought in then (the step waits on the GPU, not the host), and when both slots are taken it gets a
slot of its own for that step. Host tensors are the optimizer's state (`optimizer.state[p]["exp_avg"]`), so DCP saves
and loads them as it does any CPU tensor; `flush()` first waits for every copy in flight and forgets what the slots
hold.

All host moments are views of one flat buffer, pinned with `cudaHostRegister` at its exact size. Pinned through
torch's caching host allocator (`pin_memory=True`) each tensor would be rounded up to a power of two: an 8B model's
embedding and head moments (2.1 GB each) to 4 GiB, its MLP matrices' by 14%, ~15 GB more pinned for `all`. Before
allocating, the buffer's size is checked against the memory the host has available, so a model too large for the
host is a clear error rather than the kernel's out-of-memory kill.

On a CPU "device" the copies are plain copies (no streams) and nothing is pinned: the bookkeeping runs and is tested
there, with nothing to overlap.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

# Room the buffer leaves on the host: the data loader, checkpoint staging, the CUDA context, the Python heap.
HOST_HEADROOM = 4 << 30


def offload_units(lm: nn.Module, mode: str | int) -> list[list[nn.Parameter]]:
    """The trained parameters whose moments `mode` puts on the host, as units in the backward's order: `off` none;
    a number N, N decoder layers spread evenly over the stack; `all`, every decoder layer and each other trained
    parameter (embeddings, final norm, head) on its own."""
    from sftflow.tasks.train.activations import spread
    from sftflow.tasks.train.model import decoder_layers

    if mode == "off" or mode == 0:
        return []
    layers = decoder_layers(lm)
    chosen = layers if mode == "all" else [layers[i] for i in spread(int(mode), len(layers))]
    units = [[p for p in layer.parameters() if p.requires_grad] for layer in chosen]
    if mode == "all":
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        units += [[p] for p in lm.parameters() if p.requires_grad and id(p) not in in_layers]
    first = {id(p): i for i, p in enumerate(lm.parameters())}
    units = [u for u in units if u]
    # gradients come last layer first: the reverse of the order the parameters are registered in
    return sorted(units, key=lambda u: -min(first[id(p)] for p in u))


def describe_units(units: list[Unit]) -> str:
    """For the worker's first line: how many units, how many parameters they hold, and the host bytes of their
    moments."""
    numel = sum(u.numel for u in units)
    plural = "" if len(units) == 1 else "s"
    return f"{len(units)} unit{plural}, {numel / 1e6:.1f}M parameters, {numel * 8 / 2**30:.1f} GiB on the host"


def available_host_bytes() -> int | None:
    """`MemAvailable` from /proc/meminfo (what the host can give without swapping), or None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_room(nbytes: int, available: int | None) -> None:
    """Refuse to allocate `nbytes` of host moments where the host has less than that (and its headroom) available."""
    if available is not None and nbytes + HOST_HEADROOM > available:
        raise MemoryError(
            f"train.optimizer.offload: the offloaded AdamW moments take {nbytes / 2**30:.1f} GiB of host memory, "
            f"and this host has {available / 2**30:.1f} GiB available ({HOST_HEADROOM / 2**30:.0f} GiB of it kept "
            "for the rest of the process); offload fewer layers (`train.optimizer.offload: N`) or use a host with "
            "more memory"
        )


def _unpin(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def pinned_flat(numel: int, pin: bool) -> torch.Tensor:
    """A zeroed fp32 host buffer of exactly `numel` elements, page-locked with `cudaHostRegister` when `pin` (so
    copies to and from it are asynchronous DMA), unpinned when the buffer is freed."""
    flat = torch.zeros(numel, dtype=torch.float32)
    if pin and numel:
        err = int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), numel * 4, 0))
        if err != 0:
            raise RuntimeError(
                f"train.optimizer.offload: pinning {numel * 4 / 2**30:.1f} GiB of host memory failed "
                f"(cudaHostRegister error {err}); the host may limit locked memory (`ulimit -l`)"
            )
        # The storage, not this tensor object, lives as long as any view of it (the optimizer's state).
        weakref.finalize(flat.untyped_storage(), _unpin, flat.data_ptr())
    return flat


def offloaded_numel(lm: nn.Module, mode: str | int) -> tuple[int, int]:
    """(parameters whose moments `mode` offloads, the largest unit's): for the memory estimate."""
    units = offload_units(lm, mode)
    sizes = [sum(p.numel() for p in u) for u in units]
    return sum(sizes), max(sizes, default=0)


@dataclass(eq=False)
class Slot:
    """Device room for one unit's two moments (`buf`: (2, numel) fp32). `released`: the event after which the last
    copy out of it has read it (None: nothing in flight)."""

    buf: torch.Tensor
    released: object | None = None
    spare: bool = False  # made for one unit when both persistent slots were taken; dropped after it


@dataclass(eq=False)
class Unit:
    """Parameters stepped together and moved together: their host moments (per parameter, pinned) and, while on the
    device, their slot."""

    params: list[nn.Parameter]
    host: list[tuple[torch.Tensor, torch.Tensor]]
    numel: int
    slot: Slot | None = None
    ready: object | None = None  # event: the copy in has landed
    waited: bool = False  # the compute stream already waits on `ready` this round
    written: object | None = None  # event: the last copy out has landed in `host`
    stepped: set[int] = field(default_factory=set)  # ids of the parameters stepped this round
    done: bool = False  # stepped and sent back this round


class HostMoments:
    """The moments of `units` (lists of parameters, in the order their gradients usually come: the backward's) on the
    host, streamed through `slots` device slots. `moments(p)` gives `p`'s device moments for its step; `stepped(p)`
    says it is done (the unit goes back once all of its parameters are); `end_round()` closes the step and brings the
    next step's first units in."""

    def __init__(self, units: list[list[nn.Parameter]], device: torch.device, slots: int = 2):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        numel = sum(p.numel() for params in units for p in params)
        check_host_room(numel * 8, available_host_bytes())
        self.flat = pinned_flat(2 * numel, pin=self.cuda)
        self.units: list[Unit] = []
        offset = 0
        for params in units:
            host = []
            for p in params:
                n = p.numel()
                host.append((self.flat[offset : offset + n].view(p.shape),
                             self.flat[offset + n : offset + 2 * n].view(p.shape)))  # fmt: skip
                offset += 2 * n
            self.units.append(Unit(list(params), host, sum(p.numel() for p in params)))
        self.unit_of = {id(p): u for u in self.units for p in u.params}
        self.index_of = {id(p): i for u in self.units for i, p in enumerate(u.params)}
        largest = max((u.numel for u in self.units), default=0)
        self.slots = [self._new_slot(largest) for _ in range(min(slots, len(self.units)))]
        self.copy_in = torch.cuda.Stream(self.device) if self.cuda else None
        self.copy_out = torch.cuda.Stream(self.device) if self.cuda else None
        if self.cuda:  # the slots were allocated on the compute stream, maybe in blocks its queued work still reads
            self.copy_in.wait_stream(torch.cuda.current_stream(self.device))
            self.copy_out.wait_stream(torch.cuda.current_stream(self.device))

    def _new_slot(self, numel: int, spare: bool = False) -> Slot:
        return Slot(torch.empty(2, numel, dtype=torch.float32, device=self.device), spare=spare)

    def _event(self, stream):
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def __contains__(self, p: nn.Parameter) -> bool:
        return id(p) in self.unit_of

    def host(self, p: nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        """`p`'s host moments: what the optimizer's state holds (and checkpoints)."""
        return self.unit_of[id(p)].host[self.index_of[id(p)]]

    def bytes_on_device(self) -> int:
        return sum(s.buf.numel() * 4 for s in self.slots)

    # -- in -----------------------------------------------------------------------------------------------------------

    def _views(self, unit: Unit) -> list[tuple[torch.Tensor, torch.Tensor]]:
        views, offset = [], 0
        for p in unit.params:
            n = p.numel()
            views.append((unit.slot.buf[0, offset : offset + n].view(p.shape),
                          unit.slot.buf[1, offset : offset + n].view(p.shape)))  # fmt: skip
            offset += n
        return views

    def _free_slot(self) -> Slot | None:
        taken = {id(u.slot) for u in self.units if u.slot is not None}
        return next((s for s in self.slots if id(s) not in taken), None)

    def _bring_in(self, unit: Unit, slot: Slot) -> None:
        unit.slot, unit.waited = slot, False
        views = self._views(unit)
        if not self.cuda:
            for (m, v), (hm, hv) in zip(views, unit.host, strict=True):
                m.copy_(hm)
                v.copy_(hv)
            return
        with torch.cuda.stream(self.copy_in):
            for event in (slot.released, unit.written):  # the slot is read out; the host holds the latest moments
                if event is not None:
                    self.copy_in.wait_event(event)
            if slot.spare:
                # Made on the compute stream just now, maybe in a block that its queued work still reads: written only
                # after that work (the step waits for this copy anyway). Freed after the copy streams' uses of it too.
                self.copy_in.wait_stream(torch.cuda.current_stream(self.device))
                slot.buf.record_stream(self.copy_in)
                slot.buf.record_stream(self.copy_out)
            for (m, v), (hm, hv) in zip(views, unit.host, strict=True):
                m.copy_(hm, non_blocking=True)
                v.copy_(hv, non_blocking=True)
        unit.ready = self._event(self.copy_in)

    def prefetch(self) -> None:
        """Bring in the next units of the usual order that are not stepped or on the device yet, while slots are
        free (never a spare slot: prefetching is a guess)."""
        for unit in self.units:
            if unit.done or unit.slot is not None:
                continue
            slot = self._free_slot()
            if slot is None:
                return
            self._bring_in(unit, slot)

    def moments(self, p: nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        """`p`'s moments on the device, for its step on the current stream (which waits for them to land)."""
        unit = self.unit_of[id(p)]
        if unit.slot is None:
            slot = self._free_slot() or self._new_slot(unit.numel, spare=True)
            self._bring_in(unit, slot)
        if self.cuda and not unit.waited:
            torch.cuda.current_stream(self.device).wait_event(unit.ready)
            unit.waited = True
        return self._views(unit)[self.index_of[id(p)]]

    # -- out ----------------------------------------------------------------------------------------------------------

    def finish(self, unit: Unit) -> None:
        """`unit`'s steps are queued (some parameters may have had no gradient): its moments go back."""
        self._send_back(unit)
        self.prefetch()

    def stepped(self, p: nn.Parameter) -> None:
        """`p`'s step is queued; once its unit's last parameter is, the unit's moments go back to the host."""
        unit = self.unit_of[id(p)]
        unit.stepped.add(id(p))
        if len(unit.stepped) == len(unit.params):
            self._send_back(unit)
            self.prefetch()

    def _send_back(self, unit: Unit) -> None:
        views, slot = self._views(unit), unit.slot
        if not self.cuda:
            for (m, v), (hm, hv) in zip(views, unit.host, strict=True):
                hm.copy_(m)
                hv.copy_(v)
        else:
            stepped = self._event(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_out):
                self.copy_out.wait_event(stepped)
                for (m, v), (hm, hv) in zip(views, unit.host, strict=True):
                    hm.copy_(m, non_blocking=True)
                    hv.copy_(v, non_blocking=True)
            unit.written = slot.released = self._event(self.copy_out)
        unit.slot, unit.stepped, unit.waited = None, set(), False
        unit.done = True

    def end_round(self) -> None:
        """The step is over: units with parameters that had no gradient go back as they are, and the next step's
        first units come in (they are ready long before the backward reaches them)."""
        for unit in self.units:
            if unit.stepped:
                self._send_back(unit)
            unit.done = False
        self.prefetch()

    def flush(self) -> None:
        """Wait for every copy in flight and forget what the slots hold: the host moments are then the state, to
        read (save) or overwrite (load)."""
        for unit in self.units:
            if unit.stepped:
                self._send_back(unit)
            unit.slot, unit.waited, unit.done = None, False, False
        if self.cuda:
            self.copy_in.synchronize()
            self.copy_out.synchronize()
            for slot in self.slots:
                slot.released = None
            for unit in self.units:
                unit.written = unit.ready = None
