"""QLoRA (`train.quantize: nf4`): the refusals before launch, the 4-bit base as it is loaded, and a run on one GPU.

The NF4 tests need bitsandbytes (`sftflow[qlora]`) and are skipped without it. The loading test runs on CPU as well
(bitsandbytes has CPU kernels), though the launcher only trains on CUDA.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch

from sftflow.tasks.plan.planner import PlanConfig
from sftflow.tasks.train.config import LoraSettings, TrainConfig
from sftflow.tasks.train.quantize import nf4_refusal
from tests.tasks.family_configs import family_config
from tests.tasks.train_helpers import losses, merged_fields, planned_mock, read_dcp, run

VOCAB = 101
LORA = {"rank": 4, "alpha": 8.0}
MOCK = dict(num_docs=40, median_length=24, max_length=60, min_token_id=3, tokens="arithmetic")
# NF4 rounds each weight to one of 16 levels scaled by its block's absmax, an error of ~9% of the weights' RMS on
# normal weights (`NF4_WEIGHT_ERROR`). On these tiny random models that moves one document's loss by 1e-5 to 4e-3
# relative (measured over three families and seeds, CPU).
NF4_LOSS_RTOL = 1e-2
NF4_WEIGHT_ERROR = (0.05, 0.12)

needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")


def save_tiny_llama(folder: Path) -> Path:
    """Llama-3.1-shaped (untied head), tiny, random, saved as a Hugging Face folder. Every linear's input width is a
    multiple of NF4's 64-weight blocks: bitsandbytes' CPU dequantisation (0.50) is wrong for other widths (its
    codes and absmaxes are right; the CUDA kernels are not affected), and the loading test runs on CPU too."""
    from transformers import AutoModelForCausalLM

    config = family_config("llama3_untied", VOCAB)
    config.intermediate_size = 128
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora")
    folder = save_tiny_llama(root / "base")
    plan_config = PlanConfig(num_ranks=1, tokens_per_rank=192, micro_batches_per_step=1, epochs=2, seed=0)
    base, dataset, _ = planned_mock(
        root,
        VOCAB,
        None,
        plan_config,
        mock=MOCK,
        model=str(folder),
        tokenizer=None,
        lora=LORA,
        quantize="nf4",
        optimizer=dict(lr=3e-2),
    )
    return root, folder, base, dataset


def test_the_launcher_refuses_what_it_cannot_train_with_the_fix(setup):
    """Real launches on this machine, each stopped before torchrun with one line that says what to do instead."""
    from sftflow.tasks.train.launch import train

    root, _, base, _ = setup
    cases = {
        "nproc": ({"nproc": 2}, r"trains on one GPU, and this run has 2 ranks .* set nproc: 1, or train LoRA"),
        "fsdp": ({"parallel": "fsdp"}, r"not under FSDP; set parallel: auto or single"),
        "preset": ({"model": "tiny-llama"}, r"'tiny-llama' is a random init; give train.model a Hugging Face folder"),
        "cpu": ({"device": "cpu"}, r"runs on CUDA GPUs only .* train LoRA on the bf16 base instead"),
    }
    for name, (update, message) in cases.items():
        config = TrainConfig.model_validate({**base.model_dump(), "out": str(root / name), **update})
        with pytest.raises(ValueError, match=message):
            train(config)
        assert not (root / name / "run.json").exists()  # refused before anything was launched


def test_refusals_on_the_facts_of_the_machine(setup):
    """What the launcher decides from what it finds (a GPU, bitsandbytes): the cases this machine cannot show."""
    _, _, base, _ = setup
    on_gpu = base.model_copy(update={"device": "auto"})
    assert "needs bitsandbytes: pip install 'sftflow[qlora]'" in nf4_refusal(on_gpu, cuda=True, bitsandbytes=False)
    assert "runs on CUDA GPUs only" in nf4_refusal(on_gpu, cuda=False, bitsandbytes=True)
    assert nf4_refusal(on_gpu, cuda=True, bitsandbytes=True) is None
    two_nodes = base.model_copy(update={"nnodes": 2})
    assert "this run has 2 ranks" in nf4_refusal(two_nodes, cuda=True, bitsandbytes=True)


def _lora_model(folder: Path, quantize: bool, device: torch.device, from_memory: bool = False):
    """The worker's one-device LoRA model of `folder` (bf16 base, fp32 adapters), its base in NF4 with `quantize`."""
    from sftflow.tasks.train.lora import apply_lora, compute_adapters_in_autocast, freeze_in_dtype
    from sftflow.tasks.train.model import CausalLMLoss, build_model, build_training_model
    from sftflow.tasks.train.quantize import quantize_base
    from sftflow.tasks.train.weights import materialize

    if from_memory:  # what transformers loads whole (a hub id, a checkpoint not read by slices)
        lm, files = build_model(str(folder), vocab_size=VOCAB, packed=False), None
    else:
        lm, files = build_training_model(str(folder), vocab_size=VOCAB, packed=False)
    apply_lora(lm, LoraSettings(**LORA), str(folder))
    freeze_in_dtype(lm, torch.bfloat16)
    if quantize:
        quantize_base(lm, device, files, torch.bfloat16)
    elif files is not None:
        materialize(lm, lm, device, files)
    lm.to(device)  # as the worker does after loading: the 4-bit weights survive a move to where they are
    compute_adapters_in_autocast(lm)
    return lm, CausalLMLoss(lm, autocast_dtype=torch.bfloat16)


def _mean_loss(model, dataset, device) -> torch.Tensor:
    ids = torch.as_tensor(dataset[0][0], device=device)[None]
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    positions = torch.arange(ids.shape[1], device=device)[None]
    return model(input_ids=ids, position_ids=positions, labels=labels) / (ids.shape[1] - 1)


@needs_bnb
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_base_is_loaded_into_nf4_layer_by_layer(setup, device):
    import bitsandbytes as bnb

    from sftflow.tasks.train.checkpoint import ModelState
    from sftflow.tasks.train.quantize import frozen_linear_names

    _, folder, _, dataset = setup
    device = torch.device(device)
    lm, model = _lora_model(folder, quantize=True, device=device)
    wrapped = {name: module for name, module in lm.named_modules() if name.endswith(".base_layer")}
    assert len(wrapped) == 14 and not frozen_linear_names(lm)  # 7 projections x 2 layers, none left in bf16
    for module in wrapped.values():
        assert isinstance(module, bnb.nn.Linear4bit) and module.weight.device.type == device.type
        assert module.weight.quant_type == "nf4" and module.weight.quant_state.nested  # double quantisation
        assert module.compute_dtype == torch.bfloat16 and module.weight.dtype == torch.uint8
    from safetensors.torch import load_file

    from sftflow.tasks.train.lora import checkpoint_name

    original = load_file(str(folder / "model.safetensors"))
    for name, module in wrapped.items():
        weight = original[checkpoint_name(f"{name}.weight")].to(torch.bfloat16).float()
        restored = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state).float().cpu()
        error = ((restored - weight).norm() / weight.norm()).item()
        assert NF4_WEIGHT_ERROR[0] < error < NF4_WEIGHT_ERROR[1], (name, error)
    assert type(lm.lm_head) is torch.nn.Linear and lm.lm_head.weight.dtype == torch.bfloat16
    assert lm.get_input_embeddings().weight.dtype == torch.bfloat16
    trained = {n for n, p in lm.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert all(lm.get_parameter(n).dtype == torch.float32 for n in trained)

    loss = _mean_loss(model, dataset, device)
    loss.backward()
    assert {n for n, p in lm.named_parameters() if p.grad is not None} == trained
    _, bf16 = _lora_model(folder, quantize=False, device=device)
    with torch.no_grad():
        reference = _mean_loss(bf16, dataset, device)
    assert loss.item() == pytest.approx(reference.item(), rel=NF4_LOSS_RTOL)
    assert loss.item() != reference.item()  # the base really is quantised
    assert set(ModelState(lm, trained_only=True).state_dict()) == trained  # checkpoints hold the adapters only

    # A model transformers loaded whole is quantised from its own weights to the same codes.
    from_memory, _ = _lora_model(folder, quantize=True, device=device, from_memory=True)
    for name, module in wrapped.items():
        other = from_memory.get_submodule(name)
        assert torch.equal(other.weight.data, module.weight.data), name
        assert torch.equal(other.weight.quant_state.absmax, module.weight.quant_state.absmax), name


@needs_bnb
@pytest.mark.gpu
def test_qlora_trains_on_one_gpu_and_exports_against_the_original_base(setup, caplog):
    """The worker on one GPU (no FSDP, compiled layers, the Triton kernels, NF4 base): step 1 is the base model's
    loss within NF4's error, only the adapters train and the loss goes down, the checkpoint holds the adapters, and
    the exported adapter loads with peft on the original base to the merged model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, folder, base, dataset = setup
    gpu = TrainConfig.model_validate(
        merged_fields(base.model_dump(), {"device": "cuda", "memory": {"compile": "auto", "dtype": "bf16"}})
    )
    run(
        gpu, root / "lora", max_steps=1, quantize="none", memory=dict(compile="off")
    )  # eager: compiled moves it ~1e-3 at most
    with caplog.at_level(logging.INFO, logger="sftflow.train"):
        run(gpu, root / "qlora", max_steps=12, export=True)
    assert "quantize: 14 frozen linear layers in NF4" in caplog.text
    trace, reference = losses(root / "qlora"), losses(root / "lora")[0]
    assert trace[0] == pytest.approx(reference, rel=NF4_LOSS_RTOL) and trace[0] != reference
    assert trace[-1] < trace[0]
    saved = read_dcp(root / "qlora" / "checkpoints" / "step-12", "model.")
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)

    merged = AutoModelForCausalLM.from_pretrained(root / "qlora" / "hf", dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    want, got = original.state_dict(), merged.state_dict()
    changed = {k for k in want if not torch.equal(got[k], want[k].to(torch.bfloat16).float())}
    assert changed and all(k.endswith("_proj.weight") for k in changed)  # merged into the bf16 original, nothing else
    ids = torch.as_tensor(dataset[0][0])[None]
    with_adapter = PeftModel.from_pretrained(original.to(torch.bfloat16).float(), root / "qlora" / "hf" / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(ids).logits, merged(ids).logits, rtol=1e-4, atol=1e-4)
