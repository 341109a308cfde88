"""Backend selection shared by the kernels: an environment override, a preference order, and a log line once.

Each kernel module describes its backends as ``name -> availability check``; the check returns ``None`` when the
backend can run on the given device and dtype, or a short reason why not. ``select`` applies the override
(``SFTFLOW_ATTENTION`` / ``SFTFLOW_CROSS_ENTROPY``), else walks the kernel's preference order, and logs the choice
and the reason once per distinct choice on the ``sftflow.kernels`` logger.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger("sftflow.kernels")

Availability = Callable[[torch.device, torch.dtype], "str | None"]

_logged: set[tuple[str, str, str]] = set()
_last_choice: dict[str, BackendChoice] = {}


@dataclass(frozen=True)
class BackendChoice:
    """Which backend a kernel runs, and why (forced by the environment, or the first available in preference order)."""

    kernel: str
    name: str
    reason: str


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Triton runs on CUDA, or on CPU when TRITON_INTERPRET=1 was set before triton was imported."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"triton needs CUDA (or TRITON_INTERPRET=1 on CPU); tensors are on {device.type}"


def always_available(device: torch.device, dtype: torch.dtype) -> str | None:
    return None


def triton_available(device: torch.device, dtype: torch.dtype) -> str | None:
    return triton_unavailable_reason(device)


# Kernels with a Triton implementation and a PyTorch reference: Triton first on CUDA, the reference first elsewhere.
TRITON_OR_REFERENCE: dict[str, Availability] = {"triton": triton_available, "reference": always_available}
TRITON_ON_CUDA: dict[str, tuple[str, ...]] = {"cuda": ("triton", "reference"), "cpu": ("reference", "triton")}


def select(
    kernel: str,
    env_var: str,
    backends: dict[str, Availability],
    preference: Sequence[str],
    device: torch.device,
    dtype: torch.dtype,
) -> BackendChoice:
    """Pick a backend for `kernel`: `env_var` forces one by name, otherwise the first available in `preference`."""
    choice = choose(kernel, env_var, backends, preference, device, dtype)
    key = (kernel, choice.name, choice.reason)
    if key not in _logged:
        _logged.add(key)
        logger.info("%s backend: %s (%s)", kernel, choice.name, choice.reason)
    _last_choice[kernel] = choice
    return choice


def choose(
    kernel: str,
    env_var: str,
    backends: dict[str, Availability],
    preference: Sequence[str],
    device: torch.device,
    dtype: torch.dtype,
) -> BackendChoice:
    """`select`'s choice, neither logged nor recorded as the last one: what a run on `device` will pick, known
    before it starts."""
    forced = os.environ.get(env_var, "").strip()
    if forced:
        if forced not in backends:
            raise ValueError(f"{env_var}={forced!r} is not a {kernel} backend; expected one of {sorted(backends)}")
        why_not = backends[forced](device, dtype)
        if why_not is not None:
            raise ValueError(f"{env_var}={forced!r} cannot run on {device.type}/{dtype}: {why_not}")
        choice = BackendChoice(kernel, forced, f"forced by {env_var}")
    else:
        skipped = []
        choice = None
        for name in preference:
            why_not = backends[name](device, dtype)
            if why_not is None:
                reason = (
                    f"first available for {device.type}/{str(dtype).removeprefix('torch.')} in order {list(preference)}"
                )
                if skipped:
                    reason += "; skipped " + "; ".join(skipped)
                choice = BackendChoice(kernel, name, reason)
                break
            skipped.append(f"{name}: {why_not}")
        if choice is None:
            raise ValueError(f"no {kernel} backend can run on {device.type}/{dtype}: " + "; ".join(skipped))
    return choice


def last_choice(kernel: str) -> BackendChoice | None:
    """The backend the last call of `kernel` ran with, or None if it has not run in this process."""
    return _last_choice.get(kernel)
