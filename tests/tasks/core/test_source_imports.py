"""A checkout's root on sys.path (`python -c`/`-m` from it, as torchrun starts the workers) must not make its
`kernels/` folder the top-level `kernels` that transformers imports when it loads a model."""

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sftflow.tasks.core.imports import SOURCE_ROOT


def _run_in_checkout(code: str, root: Path = SOURCE_ROOT) -> subprocess.CompletedProcess:
    # `python -c` puts the working directory (here a checkout's root) first on sys.path
    return subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)


FIND_KERNELS = (
    "import sftflow.tasks, importlib.util; s = importlib.util.find_spec('kernels'); print(s.origin if s else None)"
)


def _expected_kernels(root: Path) -> str:
    try:  # the PyPI package where one is installed, else the normal lookup (the checkout's folder)
        return str(importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py"))
    except importlib.metadata.PackageNotFoundError:
        return str(root / "kernels" / "__init__.py")


@pytest.mark.skipif(not (SOURCE_ROOT / "kernels").is_dir(), reason="not a checkout (installed from a wheel)")
def test_top_level_kernels_is_the_installed_package_or_absent():
    out = _run_in_checkout(FIND_KERNELS)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == _expected_kernels(SOURCE_ROOT)


@pytest.mark.skipif(not (SOURCE_ROOT / "kernels").is_dir(), reason="not a checkout (installed from a wheel)")
def test_another_checkouts_root_does_not_shadow_the_installed_package_either(tmp_path):
    """sftflow installed from one clone, a command started from another clone's root."""
    other = tmp_path / "other-clone"
    for folder in ("flows", "tasks", "kernels"):
        shutil.copytree(SOURCE_ROOT / folder, other / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = _run_in_checkout(FIND_KERNELS, other)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == _expected_kernels(other)


@pytest.mark.skipif(not (SOURCE_ROOT / "kernels").is_dir(), reason="not a checkout (installed from a wheel)")
def test_a_model_loads_with_the_checkout_on_sys_path():
    code = (
        "import sftflow.tasks\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,"
        " num_attention_heads=2, num_key_value_heads=1)\n"
        "print(type(LlamaForCausalLM(cfg)).__name__)\n"
    )
    out = _run_in_checkout(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "LlamaForCausalLM"
