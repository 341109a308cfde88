"""The GPU workloads' model files (`benchmarks/workloads/*.json`, Hugging Face config files a run config names) are
the shapes their baselines run (`benchmarks/train_throughput.py --preset`, shapes of `sftflow.tasks.shapes`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from sftflow.tasks.shapes import SHAPES

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from throughput.common import PRESET_SHAPES  # noqa: E402
from workload import WORKLOAD_PRESET, WORKLOADS  # noqa: E402


@pytest.mark.parametrize("workload", sorted(WORKLOAD_PRESET))
def test_a_workload_s_model_is_its_baseline_s_shape(workload):
    config = yaml.safe_load((WORKLOADS / f"{workload}.yaml").read_text())
    model = json.loads((WORKLOADS / config["train"]["model"]).read_text())
    shape = SHAPES[PRESET_SHAPES[WORKLOAD_PRESET[workload]]]
    assert {k: model.get(k) for k in shape.structure()} == shape.structure()
