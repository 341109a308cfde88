"""Shared fixtures: a tiny tokenizer trained here, a tiny Llama config, and the optional ../shared/data folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("SFTFLOW_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
CRASH_SHIM = REPO_ROOT / "tests" / "crash_shim"  # a sitecustomize that makes training workers crash on request

# A small corpus covering ASCII, digits, punctuation, JSON-ish tool calls and multi-byte Unicode, so the tiny BPE
# produces multi-character tokens and multi-token characters alike.
TINY_CORPUS = [
    "What is 12 + 30? The answer is 42.",
    "Reverse the string 'hello' -> 'olleh'.",
    "You are a helpful assistant.",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🙂🚀, Ελληνικά, русский.",
    "The quick brown fox jumps over the lazy dog.",
    "system user assistant tool",
]


def pytest_configure(config):
    # Under `--dist loadfile`, xdist by default hands out files with the most tests first, which puts the costliest
    # files (a few long end-to-end tests each) last, leaving one worker running them while the other idles. Keep the
    # order made below instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    import torch

    # Files holding `slow` tests first (a stable sort: each file's tests stay together, in order), so that on two
    # workers the long files start at once and the many short ones fill in around them at the end.
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    from sftflow.tasks.tiny import train_tokenizer

    out = tmp_path_factory.mktemp("tiny_tokenizer")
    train_tokenizer(TINY_CORPUS * 20, out, vocab_size=400)
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is absent")
    return SHARED_DATA


class HostReads:
    """Records each op that makes the host read a tensor's value (`.item()`, `bool(t)`, `float(t)`, a tensor taken
    as a Python number by an op, `nonzero`): on a GPU each one waits for all work queued before it. A CPU test
    catches them through the dispatcher, which is where such reads show up whatever the device."""

    OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::is_nonzero")

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        reads = self.reads = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func._schema.name in HostReads.OPS:
                    import traceback

                    reads.append(f"{func._schema.name} at {traceback.format_stack(limit=4)[0].strip()}")
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self) -> list[str]:
        self.mode.__enter__()
        return self.reads

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)


@pytest.fixture
def host_reads():
    """`with host_reads() as reads: ...`, then `reads` lists the host reads of tensor values made inside."""
    return HostReads


def crash_env(spec: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) for child processes whose training workers crash as `spec` says
    (`crash_after_step=N[,rank=R][,lr=X]`; see `tests/crash_shim/sitecustomize.py`)."""
    env = dict(os.environ if env is None else env)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(CRASH_SHIM) + (os.pathsep + path if path else "")
    env["SFTFLOW_TEST_CRASH"] = spec
    return env


@pytest.fixture
def inject_crash(monkeypatch):
    """`inject_crash("crash_after_step=3")`: training workers started after this call crash so, once per run
    folder; `inject_crash(None)` stops it."""

    def inject(spec: str | None) -> None:
        if spec is None:
            monkeypatch.delenv("SFTFLOW_TEST_CRASH", raising=False)
            return
        for key, value in crash_env(spec).items():
            if os.environ.get(key) != value:
                monkeypatch.setenv(key, value)

    return inject
