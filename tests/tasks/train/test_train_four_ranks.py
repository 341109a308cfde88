"""The multi-GPU launch path with 4 gloo processes on CPU: 4 ranks train the same losses as 1
rank on the same plan, and a checkpoint saved on 4 ranks resumes on 2 (DCP resharding)."""

from __future__ import annotations

import shutil

import pytest

from sftflow.tasks.plan.planner import PlanConfig
from tests.tasks.train_helpers import losses, metrics, planned_mock, rel, run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def four(tmp_path_factory, tiny_tokenizer, tiny_tokenizer_dir):
    root = tmp_path_factory.mktemp("train4")
    base, _, arrays = planned_mock(
        root,
        len(tiny_tokenizer),
        tiny_tokenizer_dir,
        PlanConfig(num_ranks=4, tokens_per_rank=64, micro_batches_per_step=1, epochs=1, seed=0),
        mock=dict(num_docs=64),
        checkpoint=dict(every=3, keep_last=10),
    )
    run(base, root / "run4", nproc=4)
    return root, base, arrays.num_steps


def test_four_ranks_match_one_rank(four):
    root, base, num_steps = four
    run(base, root / "run1", nproc=1)
    four_ranks, one_rank = losses(root / "run4"), losses(root / "run1")
    assert len(four_ranks) == len(one_rank) == num_steps
    for step, (a, b) in enumerate(zip(four_ranks, one_rank, strict=True), 1):
        assert rel(a, b) <= 1e-4, (step, a, b)


def test_checkpoint_saved_on_four_ranks_resumes_on_two(four):
    root, base, num_steps = four
    out = root / "resume2"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(root / "run4" / "checkpoints" / "step-3", out / "checkpoints" / "step-3")
    (out / "checkpoints" / "latest").write_text("step-3")
    run(base, out, nproc=2, checkpoint=dict(resume=True))
    assert [m["step"] for m in metrics(out)] == list(range(4, num_steps + 1))
    for a, b in zip(losses(out), losses(root / "run4")[3:], strict=True):
        assert rel(a, b) <= 1e-4
