"""The bundled demo configuration: what `sftflow run` trains when given no config file.

Generated conversations (arithmetic, string reversal, capitals, a toy tool call), a ChatML template with generation
tags, a BPE tokenizer trained on the data and a tiny random-init Llama. It runs on two CPU cores in a few minutes.
"""

from __future__ import annotations

from importlib import resources

from sftflow.flows.config import SFTConfig

DEMO_CONFIG = "demo.yaml"


def demo_config_text() -> str:
    return resources.files("sftflow.flows").joinpath(DEMO_CONFIG).read_text()


def demo_config(work_dir: str | None = None) -> SFTConfig:
    """The demo's config; `work_dir` replaces its own."""
    import yaml

    raw = yaml.safe_load(demo_config_text())
    if work_dir is not None:
        raw["work_dir"] = work_dir
    return SFTConfig.model_validate(raw)
