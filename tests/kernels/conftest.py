"""Kernel tests: on a machine without CUDA, run the Triton kernels on CPU through Triton's interpreter.

TRITON_INTERPRET is read when a ``@triton.jit`` function is defined, i.e. when ``sftflow.kernels.*_triton`` is first
imported; this conftest is loaded before the kernel test modules, and those import the Triton modules lazily.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE
