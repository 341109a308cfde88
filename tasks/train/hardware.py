"""What a training run trains on, detected once (`detect_hardware`) or described by hand (a test's fake H100):
`sftflow.tasks.train.resolved` makes the run's choices for it, and `plan.tokens_per_rank: auto` sizes rows for its
free memory."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class Hardware:
    """What a run trains on: `kind` cpu or cuda, the device's `name`, the free bytes on one device (`memory`, None on
    a CPU), `count` processes in all (`ranks_on_host` of them on this host), the GPU's compute `capability`, and the
    host memory available (`host_bytes`, None where the host does not say)."""

    kind: str
    name: str
    count: int = 1
    memory: int | None = None
    total_memory: int | None = None
    capability: tuple[int, int] | None = None
    host_bytes: int | None = None
    ranks_on_host: int = 1

    def describe(self) -> str:
        if self.kind != "cuda":
            return f"{self.count} cpu process(es)"
        free = f", {self.memory / GIB:.1f} GiB free" if self.memory is not None else ""
        return f"{self.count} x {self.name}{free}"


_PROBE = """
import json, torch
free, total = torch.cuda.mem_get_info(0)
p = torch.cuda.get_device_properties(0)
print(json.dumps({"name": p.name, "free": free, "total": total, "capability": [p.major, p.minor]}))
"""


def detect_hardware(device: str, nproc: int, nnodes: int = 1) -> Hardware:
    """The hardware of a run launched from this host with `device` (auto, cpu or cuda) and `nproc` processes per
    node. A GPU is asked in a process of its own (its free memory as a worker, which holds a CUDA context of its
    own, sees it), so the launcher holds no CUDA context of its own while the workers train."""
    from sftflow.tasks.train.host_moments import available_host_bytes

    count = nproc * nnodes
    host = available_host_bytes()
    cuda = device == "cuda"
    if device == "auto":
        import torch

        cuda = torch.cuda.is_available()
    if not cuda:
        return Hardware(kind="cpu", name="cpu", count=count, host_bytes=host, ranks_on_host=nproc)
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"could not read the GPU's memory: {out.stderr.strip().splitlines()[-1:]}")
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    return Hardware(
        kind="cuda", name=probe["name"], count=count, memory=probe["free"], total_memory=probe["total"],
        capability=tuple(probe["capability"]), host_bytes=host, ranks_on_host=nproc,
    )  # fmt: skip
