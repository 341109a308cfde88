"""A checkout's root on sys.path (`python -c`/`-m` from it, as torchrun starts the workers) must not make its
`kernels/` folder the top-level `kernels` that transformers imports when it loads a model."""

import importlib.metadata
import subprocess
import sys

import pytest

from sftflow.tasks.core.imports import SOURCE_ROOT


def _run_in_checkout(code: str) -> subprocess.CompletedProcess:
    # `python -c` puts the working directory (here the checkout's root) first on sys.path
    return subprocess.run([sys.executable, "-c", code], cwd=SOURCE_ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not (SOURCE_ROOT / "kernels").is_dir(), reason="not a checkout (installed from a wheel)")
def test_top_level_kernels_is_the_installed_package_or_absent():
    out = _run_in_checkout(
        "import sftflow.tasks, importlib.util; s = importlib.util.find_spec('kernels'); print(s.origin if s else None)"
    )
    assert out.returncode == 0, out.stderr
    try:  # the PyPI package where one is installed, else the normal lookup (the checkout's folder)
        expected = str(importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py"))
    except importlib.metadata.PackageNotFoundError:
        expected = str(SOURCE_ROOT / "kernels" / "__init__.py")
    assert out.stdout.strip() == expected


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
