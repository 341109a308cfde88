"""`parallel="single"`: one process without FSDP (compute-dtype weights, fp32 masters in `MasterAdamW`), against the
FSDP path on the same plan. Real torchrun, gloo, a tiny random-init Llama on CPU.

The plan is made for 2 ranks with one micro-batch each, so a one-process run trains every step as 2 micro-batches
(the gradient accumulation path) and a 2-process FSDP run can resume its checkpoints.
"""

from __future__ import annotations

import pytest
import torch

from sftflow.tasks.plan.planner import PlanConfig
from tests.tasks.train_helpers import (
    losses,
    metrics,
    planned_mock,
    read_dcp,
    read_safetensors,
    rel,
    resume_from,
    run,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_tokenizer, tiny_tokenizer_dir):
    root = tmp_path_factory.mktemp("single")
    base, _, arrays = planned_mock(
        root,
        len(tiny_tokenizer),
        tiny_tokenizer_dir,
        PlanConfig(num_ranks=2, tokens_per_rank=96, micro_batches_per_step=1, epochs=2, seed=0),
        save_grads_at_steps=(1,),
        schedule=dict(warmup_steps=1),
        checkpoint=dict(every=3, keep_last=10),
        optimizer=dict(weight_decay=0.1),
    )
    return root, base, arrays.num_steps


@pytest.fixture(scope="module")
def fsdp_fp32(setup):
    root, base, _ = setup
    run(base, root / "fsdp", nproc=1, parallel="fsdp")
    return root / "fsdp"


@pytest.fixture(scope="module")
def single_fp32(setup):
    root, base, _ = setup
    run(base, root / "single", nproc=1, parallel="single", export=True)
    return root / "single"


def test_single_device_trains_like_fsdp_in_fp32(setup, fsdp_fp32, single_fp32):
    """Same gradients at step 1 (2 micro-batches accumulated), same losses after; checkpoints with the same keys."""
    got = read_safetensors(single_fp32 / "debug" / "grads-step-1.safetensors")
    want = read_safetensors(fsdp_fp32 / "debug" / "grads-step-1.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7 * want[name].abs().max().item())
    single, fsdp = losses(single_fp32), losses(fsdp_fp32)
    assert len(single) == setup[2] >= 6
    for step, (a, b) in enumerate(zip(single, fsdp, strict=True), 1):
        assert rel(a, b) <= 1e-4, (step, a, b)
    assert sum(single[-3:]) / 3 < sum(single[:3]) / 3 - 0.2, single  # it learns
    ckpt_single, ckpt_fsdp = single_fp32 / "checkpoints" / "step-3", fsdp_fp32 / "checkpoints" / "step-3"
    a, b = read_dcp(ckpt_single), read_dcp(ckpt_fsdp)
    assert a.keys() == b.keys()
    for key in b:
        assert a[key].dtype == b[key].dtype, key  # fp32 masters, fp32 moments, fp32 step counters
        if key.startswith("optimizer.state."):
            torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6, msg=key)
        elif key.startswith("model."):
            # Adam divides by sqrt(v): where a weight's gradient is near zero (an embedding row seen once), the
            # gradient's fp32 summation-order noise becomes ~1e-6 of the weight after a few steps of lr 1e-2.
            torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)


def test_single_device_bf16_matches_fsdp_mixed_precision(setup):
    """bf16 compute: FSDP's bf16 copies of fp32 masters vs bf16 parameters split from the optimizer's fp32 masters."""
    root, base, _ = setup
    runs = {}
    for parallel in ("fsdp", "single"):
        out = root / f"bf16-{parallel}"
        run(
            base,
            out,
            nproc=1,
            parallel=parallel,
            save_grads_at_steps=(),
            memory=dict(dtype="bf16"),
            checkpoint=dict(every=0),
            optimizer=dict(lr=1e-3),
        )
        runs[parallel] = losses(out)
    # lr 1e-3: at 1e-2 this tiny model's bf16 runs drift apart chaotically (1% by step 20) from flips of single
    # weights across a bf16 rounding boundary, which the two optimizers' fp32 summation orders place differently
    for step, (a, b) in enumerate(zip(runs["single"], runs["fsdp"], strict=True), 1):
        assert rel(a, b) <= 5e-4, (step, a, b)
    masters = read_dcp(root / "bf16-single" / "checkpoints" / f"step-{setup[2]}", "model.")
    assert masters and all(v.dtype == torch.float32 for v in masters.values())


@pytest.fixture(scope="module")
def single_to_fsdp(setup, single_fp32):
    """The one-device run's step-3 checkpoint resumed on 2 FSDP ranks, whose checkpoints hold each tensor in 2
    chunks, one from each rank."""
    root, base, _ = setup
    out = root / "single-to-fsdp"
    resume_from(single_fp32, 3, out)
    run(base, out, nproc=2, parallel="fsdp", save_grads_at_steps=(), checkpoint=dict(resume=True))
    return out


@pytest.mark.parametrize("saved, resumed", [("single", "fsdp"), ("fsdp", "single"), ("fsdp on 2 ranks", "single")])
def test_checkpoints_move_between_single_and_fsdp(setup, fsdp_fp32, single_fp32, single_to_fsdp, saved, resumed):
    root, base, num_steps = setup
    if saved == "single":  # resumed on 2 FSDP ranks by the fixture
        out, start, source = single_to_fsdp, 3, single_fp32
    else:  # a one-device run takes over an FSDP run's checkpoint: its masters arrive a chunk at a time
        start = 3 if saved == "fsdp" else 6
        assert num_steps > start
        if saved == "fsdp on 2 ranks":
            import torch.distributed.checkpoint as dcp

            metadata = dcp.FileSystemReader(str(single_to_fsdp / "checkpoints" / "step-6")).read_metadata()
            chunks = [len(m.chunks) for k, m in metadata.state_dict_metadata.items() if k.startswith("model.")]
            assert max(chunks) == 2
        out = root / f"{saved}-to-{resumed}".replace(" ", "-")
        resume_from(fsdp_fp32 if saved == "fsdp" else single_to_fsdp, start, out)
        run(base, out, nproc=1, parallel=resumed, save_grads_at_steps=(), checkpoint=dict(resume=True))
        source = fsdp_fp32
    assert [r["step"] for r in metrics(out)] == list(range(start + 1, num_steps + 1))
    for step, (a, b) in enumerate(zip(losses(out), losses(source)[start:], strict=True), start + 1):
        assert rel(a, b) <= 1e-4, (step, a, b)


def test_single_device_export_holds_the_masters(setup, single_fp32):
    from transformers import AutoModelForCausalLM

    from sftflow.tasks.train.checkpoint import load_model_weights
    from sftflow.tasks.train.model import build_model

    exported = AutoModelForCausalLM.from_pretrained(single_fp32 / "hf")
    trained = build_model("tiny-llama", vocab_size=exported.config.vocab_size, packed=False)
    load_model_weights(single_fp32 / "checkpoints" / f"step-{setup[2]}", trained)
    for (name, a), (_, b) in zip(exported.state_dict().items(), trained.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_single_refuses_more_than_one_process(setup):
    root, base, _ = setup
    with pytest.raises(ValueError, match="parallel='single' trains in one process"):
        run(base, root / "refused", nproc=2, parallel="single")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, tiny_tokenizer, tiny_tokenizer_dir):
    root = tmp_path_factory.mktemp("in-backward")
    base, _, arrays = planned_mock(
        root,
        len(tiny_tokenizer),
        tiny_tokenizer_dir,
        PlanConfig(num_ranks=1, tokens_per_rank=96, micro_batches_per_step=1, epochs=1, seed=0),
        parallel="single",
        schedule=dict(warmup_steps=1),
        checkpoint=dict(every=3, keep_last=10),
        optimizer=dict(weight_decay=0.1, grad_clip=None),
        memory=dict(dtype="bf16"),
    )
    return root, base, arrays.num_steps


def test_stepping_in_the_backward_and_moments_on_the_host_train_as_the_plain_step(one_rank):
    """bf16 weights, fp32 masters, one micro-batch a step: each parameter stepped in the backward (with every layer
    recomputed in it, and one layer's moments in host memory), or every moment in host memory with the step after
    the backward, gives the run the plain step gives, bit for bit, and the checkpoints resume."""
    root, base, num_steps = one_rank
    run(base, root / "after", memory=dict(activation_checkpointing="off"))
    run(
        base, root / "during", memory=dict(activation_checkpointing="full"), optimizer=dict(in_backward=True, offload=1)
    )
    run(base, root / "host", optimizer=dict(offload="all"))
    after = metrics(root / "after")
    assert len(after) == num_steps >= 6
    for name in ("during", "host"):
        got = metrics(root / name)
        assert [r["loss"] for r in got] == [r["loss"] for r in after], name
        for a, b in zip(got, after, strict=True):
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)  # summed in another order
        a, b = read_dcp(root / name / "checkpoints" / "step-3"), read_dcp(root / "after" / "checkpoints" / "step-3")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b), name
    out = root / "resumed"
    resume_from(root / "during", 3, out)
    run(base, out, checkpoint=dict(resume=True), optimizer=dict(in_backward=True, offload="all"))
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in after][3:]


def test_stepping_in_the_backward_refuses_a_plan_of_several_micro_batches(setup):
    root, base, _ = setup  # planned for 2 ranks: one process takes 2 micro-batches a step
    with pytest.raises(ValueError, match=r"has 2 a step on each of 1 process.*: plan one a step$"):
        run(
            base,
            root / "refused-in-backward",
            parallel="single",
            save_grads_at_steps=(),
            optimizer=dict(grad_clip=None, in_backward=True),
        )


def test_one_device_options_are_refused_before_launch_where_auto_means_fsdp(one_rank):
    root, base, _ = one_rank
    with pytest.raises(ValueError, match="set train.parallel: single"):
        run(base, root / "refused-auto", parallel="auto", optimizer=dict(in_backward=True))  # the CPU: auto is FSDP
    assert not (root / "refused-auto" / "run.json").exists()  # refused before the launch wrote anything


@pytest.mark.gpu
def test_a_one_gpu_run_resumes_its_masters_and_moments_from_a_checkpoint(one_rank):
    """On a GPU the checkpoint's writer copies device tensors out ahead of the file (the masters joined on the
    device as it reaches them) and a resume splits each master as it is read: the resumed run's first step computes
    the loss the uninterrupted run computed there, bit for bit, and the rest follow it."""
    root, base, num_steps = one_rank
    whole, out = root / "cuda", root / "cuda-resumed"
    run(base, whole, device="cuda", memory=dict(compile="off"), optimizer=dict(grad_clip=1.0))
    resume_from(whole, 3, out)
    run(
        base,
        out,
        device="cuda",
        memory=dict(compile="off"),
        optimizer=dict(grad_clip=1.0),
        checkpoint=dict(resume=True),
    )
    want, got = [r["loss"] for r in metrics(whole)][3:], [r["loss"] for r in metrics(out)]
    assert len(got) == len(want) == num_steps - 3
    assert got[0] == want[0]
    assert got == pytest.approx(want, rel=1e-3)  # the backward's atomics may order sums differently
