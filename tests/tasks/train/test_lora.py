"""LoRA runs on real torchrun workers (gloo, CPU): adapters on a frozen base from a Hugging Face folder, trained on
packed rows, checkpointed alone, resumed, and exported in PEFT's format."""

from __future__ import annotations

import pytest
import torch

from sftflow.tasks.plan.planner import PlanConfig
from sftflow.tasks.train.config import LoraSettings, TrainConfig
from tests.tasks.family_configs import save_family_model
from tests.tasks.train_helpers import losses, planned_mock, read_dcp, resume_from, run

pytestmark = pytest.mark.slow

VOCAB = 101
LORA = {"rank": 4, "alpha": 8.0}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    folder = save_family_model("qwen3", VOCAB, root / "base")
    plan_config = PlanConfig(num_ranks=2, tokens_per_rank=96, micro_batches_per_step=1, epochs=2, seed=0)
    mock = dict(num_docs=40, median_length=24, max_length=60, min_token_id=3, tokens="arithmetic")
    base, dataset, _ = planned_mock(
        root,
        VOCAB,
        None,
        plan_config,
        mock=mock,
        model=str(folder),
        tokenizer=None,
        optimizer=dict(lr=3e-2),
        checkpoint=dict(every=2, keep_last=10),
    )
    return root, folder, base, dataset


@pytest.fixture(scope="module")
def lora2(setup):
    root, _, base, _ = setup
    run(base, root / "lora2", nproc=2, max_steps=12, lora=LORA, export=True)
    return root / "lora2"


def test_only_the_adapters_train_and_the_loss_goes_down(setup, lora2):
    root, folder, base, _ = setup
    trace = losses(lora2)
    assert trace[-1] < trace[0]
    # Checkpoints hold the adapters (and their optimizer state), not the frozen base.
    saved = read_dcp(lora2 / "checkpoints" / "step-12", "model.")
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)
    # The merged export differs from the base exactly by the adapters' product on the wrapped layers.
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(lora2 / "hf", dtype=torch.float32).state_dict()
    original = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    changed = {k for k in original if not torch.equal(merged[k], original[k])}
    assert changed and all(k.endswith("_proj.weight") for k in changed)
    assert all("norm" not in k and "embed" not in k for k in changed)


def test_step_zero_is_the_base_model(setup, lora2):
    """lora_B starts at zero, so the first step's loss is the base model's: a full fine-tune's first loss."""
    root, _, base, _ = setup
    run(base, root / "full", nproc=1, max_steps=1)
    assert losses(lora2)[0] == pytest.approx(losses(root / "full")[0], rel=1e-6)


def test_two_ranks_equal_one_rank(setup, lora2, caplog):
    import logging

    root, _, base, _ = setup
    with caplog.at_level(logging.INFO):
        run(base, root / "lora1", nproc=1, max_steps=12, lora=LORA)
    assert losses(root / "lora1") == pytest.approx(losses(lora2), rel=1e-5)
    # The start line says what a LoRA run trains: the adapters and their size, beside the frozen base's count
    start = next(r.getMessage() for r in caplog.records if "[train] fresh start;" in r.getMessage())
    assert f"LoRA r{LORA['rank']} on " in start and "M trainable, frozen base)" in start, start


def test_a_resumed_run_is_the_run_that_was_not_stopped(setup, lora2):
    root, _, base, _ = setup
    resumed = root / "resumed"
    resume_from(lora2, 2, resumed)
    run(base, resumed, nproc=2, max_steps=12, lora=LORA, checkpoint=dict(resume=True))
    assert losses(resumed) == losses(lora2)[2:]  # the resumed folder logs steps 3..12
    want = read_dcp(lora2 / "checkpoints" / "step-12", "model.")
    got = read_dcp(resumed / "checkpoints" / "step-12", "model.")
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_the_exported_adapter_loads_with_peft_to_the_merged_logits(setup, lora2):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, folder, _, dataset = setup
    ids = torch.as_tensor(dataset[0][0])[None]
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, lora2 / "hf" / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(lora2 / "hf", dtype=torch.float32)
    with torch.no_grad():
        a, b = with_adapter(ids).logits, merged(ids).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert (lora2 / "hf" / "adapter" / "adapter_model.safetensors").is_file()
    assert not torch.allclose(a, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(ids).logits)


def test_configuration_errors_name_the_fix(setup):
    from sftflow.tasks.train.launch import train

    root, _, base, _ = setup
    with pytest.raises(
        ValueError, match=r"lora.targets: \['qkv'\] name no linear module .* \['down_proj', 'gate_proj'"
    ):
        run(base, root / "bad-targets", max_steps=1, lora={"targets": "qkv"})
    with pytest.raises(ValueError, match="runs on CUDA GPUs only"):
        train(
            TrainConfig.model_validate({**base.model_dump(), "out": str(root / "q"), "lora": LORA, "quantize": "nf4"})
        )
    with pytest.raises(ValueError, match="needs train.lora"):
        TrainConfig.model_validate({**base.model_dump(), "quantize": "nf4"})
    assert LoraSettings(rank=8).scale_alpha == 16.0


@pytest.mark.gpu
def test_lora_on_one_gpu_with_compiled_layers(tmp_path):
    """The one-GPU path (no FSDP, bf16 base, compiled layers, Triton kernels): step 1 is the base model's loss, the
    adapters learn, and the merged export carries them."""
    from transformers import AutoModelForCausalLM

    folder = save_family_model("qwen3", VOCAB, tmp_path / "base")
    plan_config = PlanConfig(num_ranks=1, tokens_per_rank=192, micro_batches_per_step=1, epochs=2, seed=0)
    mock = dict(num_docs=40, median_length=24, max_length=60, min_token_id=3, tokens="arithmetic")
    base, _, _ = planned_mock(
        tmp_path,
        VOCAB,
        None,
        plan_config,
        mock=mock,
        model=str(folder),
        tokenizer=None,
        device="cuda",
        optimizer=dict(lr=3e-2),
    )
    run(base, tmp_path / "full", max_steps=1, memory=dict(compile="auto", dtype="bf16"))
    run(base, tmp_path / "lora", max_steps=12, lora=LORA, export=True, memory=dict(compile="auto", dtype="bf16"))
    trace = losses(tmp_path / "lora")
    assert trace[0] == pytest.approx(losses(tmp_path / "full")[0], rel=1e-3)
    assert trace[-1] < trace[0]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "lora" / "hf", dtype=torch.float32).state_dict()
    original = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    assert any(not torch.equal(merged[k], original[k]) for k in original if k.endswith("q_proj.weight"))
