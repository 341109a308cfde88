"""Each supported family trains on packed rows exactly as Hugging Face computes it.

The reference is Hugging Face's own `eager` forward (its own masks, sliding windows included) over each document
alone, from the saved folder; sftflow's side is `build_model` on the same folder with the packed row of all documents
through the fused loss. Loss and every gradient must agree to fp32 rounding. Models the worker cannot reproduce are
refused before any step, naming the feature.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sftflow.tasks.train.collate import collate, packed_collator
from sftflow.tasks.train.families import check_config, family_of, router_aux_loss_coef
from sftflow.tasks.train.model import CausalLMLoss, build_model, model_batch
from tests.tasks.family_configs import FAMILY_CONFIGS, family_config, save_family_model

VOCAB = 101
# Longer than every test window (8), so windows cut; a 1-token document; loss spans that start at token 0 (never a
# target) and in the middle.
DOC_LENGTHS = (23, 1, 40, 9, 31)


def make_docs(seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    docs = []
    for length in DOC_LENGTHS:
        ids = rng.integers(3, VOCAB, length)
        spans = np.array([[0, length // 3], [length // 2, length]], dtype=np.int32)
        docs.append((ids, spans))
    return docs


def targets_of(ids: np.ndarray, spans: np.ndarray) -> list[int]:
    """Positions t whose next token is trained (t + 1 in a span): written out here, not taken from the collator."""
    trained = np.zeros(len(ids), dtype=bool)
    for start, end in spans:
        trained[start:end] = True
    return [t for t in range(len(ids) - 1) if trained[t + 1]]


def hf_reference(folder: Path, rows: list[list[tuple[np.ndarray, np.ndarray]]]):
    """(loss, gradients by parameter name) of one step of packed `rows` (ranks x micro-batches), from Hugging Face's
    own eager forward over each document alone: the cross-entropy of the step's trained targets over their count,
    plus, where the model's forward adds it, each row's router loss (on the router logits of the row's documents
    together, as one packed forward sees them), weighted by the row's targets."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
    coef = router_aux_loss_coef(model.config)
    balance = sys.modules[type(model).__module__].load_balancing_loss_func if coef is not None else None
    ce, aux_weighted, count = torch.zeros(()), torch.zeros(()), 0
    for docs in rows:
        row_targets, router_logits = 0, []
        for ids, spans in docs:
            out = model(input_ids=torch.as_tensor(ids)[None], use_cache=False, output_router_logits=coef is not None)
            positions = targets_of(ids, spans)
            if positions:
                targets = torch.as_tensor(ids[np.array(positions) + 1])
                ce = ce + torch.nn.functional.cross_entropy(out.logits[0, positions], targets, reduction="sum")
            row_targets += len(positions)
            if coef is not None:
                router_logits.append(out.router_logits)
        count += row_targets
        if coef is not None and docs:
            layers = tuple(torch.cat([d[i] for d in router_logits]) for i in range(len(router_logits[0])))
            aux = balance(layers, model.config.num_experts, model.config.num_experts_per_tok, None)
            aux_weighted = aux_weighted + coef * aux * row_targets
    loss = (ce + aux_weighted) / count
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


def packed_loss(folder: Path, docs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    lm = build_model(str(folder), vocab_size=VOCAB, packed=True)
    model = CausalLMLoss(lm)
    batch = collate(docs, packed_collator())
    loss = model(**model_batch(batch, torch.device("cpu"), VOCAB)) / int(batch["num_loss_tokens"])
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in lm.named_parameters() if p.grad is not None}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_packed_loss_and_gradients_equal_hf_eager_per_document(name, tmp_path):
    folder = save_family_model(name, VOCAB, tmp_path / name)
    docs = make_docs()
    want_loss, want_grads = hf_reference(folder, [docs])
    got_loss, got_grads = packed_loss(folder, docs)
    assert rel_err(got_loss, torch.tensor(want_loss)) <= 1e-6, (got_loss.item(), want_loss)
    # Tied heads appear once in each (under the embedding's name); every trained parameter has a gradient.
    assert got_grads.keys() == want_grads.keys()
    for pname, want in want_grads.items():
        assert rel_err(got_grads[pname], want) <= 2e-5, pname


def test_a_dropped_window_would_be_caught(tmp_path):
    """The reference sees the window: the same Mistral model without it gives a loss the test above would reject."""
    folder = save_family_model("mistral", VOCAB, tmp_path / "mistral")
    docs = make_docs()
    want, _ = hf_reference(folder, [docs])
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    config.sliding_window = None
    config.save_pretrained(folder)
    without_window, _ = packed_loss(folder, docs)
    assert rel_err(without_window, torch.tensor(want)) > 1e-4


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_layer_windows_are_the_windows_the_layers_attend_with(name, tmp_path, monkeypatch):
    """The per-layer windows the MFU's attention FLOPs assume (`layer_windows`, from the config) are the ones each
    decoder layer hands the packed attention in a forward pass."""
    from sftflow.tasks.train import model as model_module
    from sftflow.tasks.train.model import layer_windows

    folder = save_family_model(name, VOCAB, tmp_path / name)
    seen = []
    attend = model_module.varlen_attention

    def recording(q, k, v, cu_seqlens, max_seqlen, scale=None, window=None, **kw):
        seen.append(window)
        return attend(q, k, v, cu_seqlens, max_seqlen, scale, window, **kw)

    monkeypatch.setattr(model_module, "varlen_attention", recording)
    lm = build_model(str(folder), vocab_size=VOCAB, packed=True)
    with torch.no_grad():
        CausalLMLoss(lm)(**model_batch(collate(make_docs(), packed_collator()), torch.device("cpu"), VOCAB))
    assert seen == layer_windows(lm.config), (seen, layer_windows(lm.config))


def test_every_listed_config_is_a_supported_family():
    for name in FAMILY_CONFIGS:
        config = family_config(name, VOCAB)
        assert family_of(config) is not None, name
        check_config(config, packed=True, spec=name)


@pytest.mark.parametrize(
    ("model_type", "fields", "message"),
    [
        ("gemma2", dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0: a logit transform"),
        ("gemma3_text", dict(attn_logit_softcapping=50.0), "attention logit soft-capping"),
        ("llama", dict(attention_dropout=0.1), "attention_dropout=0.1"),
        ("gpt2", dict(), "model_type 'gpt2' is not one of the families"),
    ],
)
def test_models_that_cannot_be_reproduced_are_refused_with_the_feature_and_the_way_out(model_type, fields, message):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **fields)
    with pytest.raises(ValueError, match="cannot be trained exactly") as err:
        check_config(config, packed=True, spec=f"some/{model_type}")
    assert message in str(err.value)
    if model_type == "gpt2":
        assert "padded" in str(err.value)  # the way out
        check_config(config, packed=False, spec="some/gpt2")  # the model's own attention: nothing to refuse


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_every_family_is_read_shard_by_shard_not_loaded_whole(name, tmp_path):
    """Each family's checkpoint, as `save_pretrained` writes it (Qwen3-MoE: one tensor per expert), is built on the
    meta device and read by slices: `build_training_model` does not fall back to `from_pretrained` on every rank."""
    from sftflow.tasks.train.model import build_training_model
    from sftflow.tasks.train.weights import shard_loadable

    folder = save_family_model(name, VOCAB, tmp_path / name)
    lm, files = build_training_model(str(folder), vocab_size=VOCAB, packed=True)
    assert files is not None and all(p.is_meta for p in lm.parameters())
    assert shard_loadable(lm, files) == []


@pytest.mark.parametrize("name", ["llama3_untied", "gemma3", "qwen2_5", "qwen3_moe"])
def test_a_checkpoint_read_onto_a_meta_model_equals_from_pretrained(name, tmp_path):
    """Parameters from the safetensors files (Qwen3-MoE's experts stacked into its fused parameters), buffers from the
    model's own initialisation, tied heads still tied."""
    from transformers import AutoModelForCausalLM

    from sftflow.tasks.train.model import build_training_model
    from sftflow.tasks.train.weights import materialize

    folder = save_family_model(name, VOCAB, tmp_path / name)
    lm, files = build_training_model(str(folder), vocab_size=VOCAB, packed=True)
    assert files is not None and all(p.is_meta for p in lm.parameters())
    materialize(lm, lm, torch.device("cpu"), files)
    want = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    got_state, want_state = lm.state_dict(), want.state_dict()
    assert got_state.keys() == want_state.keys()
    for key, value in want_state.items():
        assert torch.equal(got_state[key], value), key
    for key, value in want.named_buffers():
        assert torch.equal(lm.get_buffer(key), value), key
    if want.config.tie_word_embeddings:
        assert lm.get_output_embeddings().weight is lm.get_input_embeddings().weight


# Through torchrun for the families whose structure touches sharding and loading most: per-layer windows and tied
# heads (Gemma 3, Qwen2.5), fused projections (Phi-3), MoE experts stacked from per-expert tensors (Qwen3-MoE), layers
# without RoPE (SmolLM3). Every family's packed loss is checked in one process above; tests/flows/test_sft_flow.py
# trains Qwen3 from a folder through the whole pipeline. (Each torchrun case costs ~20 s of CI on 2 cores.)
TORCHRUN_FAMILIES = ["gemma3", "qwen2_5", "phi3", "qwen3_moe", "smollm3"]


@pytest.mark.slow
@pytest.mark.parametrize("name", TORCHRUN_FAMILIES)
def test_two_rank_fsdp_training_from_the_folder_matches_hf_and_exports_what_it_trained(name, tmp_path):
    """`train` (torchrun, 2 gloo ranks, FSDP2, the checkpoint read shard by shard): the first step's loss and
    gradients equal Hugging Face's eager forward per document, and the exported folder reloads with the trained
    weights and the input's config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sftflow.tasks.plan.planner import PlanConfig
    from sftflow.tasks.train.data import load_plan, plan_row
    from tests.tasks.train_helpers import losses, planned_mock, read_dcp, read_safetensors, run

    folder = save_family_model(name, VOCAB, tmp_path / "model")
    plan_config = PlanConfig(num_ranks=2, tokens_per_rank=96, micro_batches_per_step=1, epochs=1, seed=0)
    mock = dict(num_docs=12, median_length=30, max_length=60, min_token_id=3)
    base, dataset, _ = planned_mock(
        tmp_path, VOCAB, None, plan_config, mock=mock, model=str(folder), tokenizer=None, save_grads_at_steps=(1,)
    )
    result = run(base, tmp_path / "run", nproc=2, max_steps=2, export=True, optimizer=dict(lr=1e-3))
    assert result.steps == 2

    plan = load_plan(tmp_path / "plan")
    rows = [[dataset[int(i)] for i in plan_row(plan, 0, 0, rank)] for rank in range(2)]
    want_loss, want_grads = hf_reference(folder, rows)
    got_loss = losses(tmp_path / "run")[0]
    assert abs(got_loss - want_loss) <= 1e-6 * abs(want_loss), (got_loss, want_loss)
    got_grads = read_safetensors(tmp_path / "run" / "debug" / "grads-step-1.safetensors")
    assert got_grads.keys() == want_grads.keys()
    for pname, want in want_grads.items():
        assert rel_err(got_grads[pname], want) <= 2e-5, pname

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32)
    trained = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    final = read_dcp(tmp_path / "run" / "checkpoints" / "step-2", "model.")
    trained.load_state_dict({k.removeprefix("model."): v for k, v in final.items()}, strict=False)
    ids = torch.as_tensor(dataset[0][0])[None]
    with torch.no_grad():
        assert torch.allclose(exported(ids).logits, trained(ids).logits, rtol=1e-5, atol=1e-5)
    source, written = AutoConfig.from_pretrained(folder).to_dict(), exported.config.to_dict()
    for key in ("architectures", "model_type", "sliding_window", "layer_types", "tie_word_embeddings"):
        assert written.get(key) == source.get(key), key
    generation = "generation_config.json"
    assert (tmp_path / "run" / "hf" / generation).read_text() == (folder / generation).read_text()


def test_the_launcher_refuses_such_a_model_before_starting_any_worker(tmp_path):
    from transformers import AutoConfig

    from sftflow.tasks.plan.planner import PlanConfig
    from tests.tasks.train_helpers import planned_mock, run

    AutoConfig.for_model("gemma2", vocab_size=VOCAB, final_logit_softcapping=30.0).save_pretrained(tmp_path / "gemma2")
    plan_config = PlanConfig(num_ranks=1, tokens_per_rank=96, micro_batches_per_step=1, epochs=1, seed=0)
    base, _, _ = planned_mock(tmp_path, VOCAB, None, plan_config, model=str(tmp_path / "gemma2"), tokenizer=None)
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0") as err:
        run(base, tmp_path / "run")
    assert "model_type 'gemma2' is not one of the families" in str(err.value)
    assert not (tmp_path / "run" / "run.json").exists()  # refused before the launcher wrote anything for torchrun


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gemma3", "mistral", "phi4_mini", "qwen2_5", "qwen3_moe", "smollm3"])
def test_compiled_layers_on_a_gpu_train_what_hf_computes(name, tmp_path):
    """The GPU path users get: one device (no FSDP), compiled decoder layers with the Triton attention op and the
    T-major RoPE inside their graphs, windows and partial RoPE included; in fp32, so that it is held to the eager
    per-document reference as tightly as on the CPU."""
    from sftflow.tasks.plan.planner import PlanConfig
    from sftflow.tasks.train.data import load_plan, plan_row
    from tests.tasks.train_helpers import losses, planned_mock, read_safetensors, run

    folder = save_family_model(name, VOCAB, tmp_path / "model")
    plan_config = PlanConfig(num_ranks=1, tokens_per_rank=192, micro_batches_per_step=1, epochs=1, seed=0)
    mock = dict(num_docs=12, median_length=30, max_length=60, min_token_id=3)
    base, dataset, _ = planned_mock(
        tmp_path, VOCAB, None, plan_config, mock=mock, model=str(folder), tokenizer=None, save_grads_at_steps=(1,)
    )
    run(
        base, tmp_path / "run", max_steps=1, device="cuda", parallel="single", memory=dict(dtype="fp32", compile="auto")
    )
    rows = [[dataset[int(i)] for i in plan_row(load_plan(tmp_path / "plan"), 0, 0, 0)]]
    want_loss, want_grads = hf_reference(folder, rows)
    got_loss = losses(tmp_path / "run")[0]
    assert abs(got_loss - want_loss) <= 1e-5 * abs(want_loss), (got_loss, want_loss)
    got_grads = read_safetensors(tmp_path / "run" / "debug" / "grads-step-1.safetensors")
    for pname, want in want_grads.items():
        assert rel_err(got_grads[pname], want) <= 1e-4, pname


def _flash_attn_4_runs() -> bool:
    from sftflow.kernels.attention_fa4 import unavailable_reason

    return torch.cuda.is_available() and unavailable_reason(torch.device("cuda"), torch.bfloat16) is None


@pytest.mark.gpu
@pytest.mark.skipif(not _flash_attn_4_runs(), reason="needs flash-attn-4 on an sm_90+ GPU")
@pytest.mark.parametrize("name", ["gemma3", "mistral", "phi4_mini", "qwen2_5", "qwen3_moe", "smollm3"])
def test_flash_attn_4_in_bf16_compiled_layers_trains_what_hf_computes(name, tmp_path, caplog, monkeypatch):
    """The default on Hopper: bf16 compiled layers with FlashAttention-4 chosen by the dispatch (windows and GQA
    included). The same bf16 step on the Triton kernels, exact against HF in fp32 (above), is the yardstick: bf16
    alone moves the gradients far from the fp32 reference (the embeddings' by half their norm in these tiny models),
    so FlashAttention-4 is held to the Triton step's own distance from HF, and to the Triton step itself. Heads of
    32 (the small configs have 16, where flash-attn-4 4.0.0b36's backward is wrong and the dispatch does not use
    it)."""
    import logging

    from sftflow.tasks.plan.planner import PlanConfig
    from sftflow.tasks.train.data import load_plan, plan_row
    from tests.tasks.train_helpers import losses, planned_mock, read_safetensors, run

    folder = save_family_model(name, VOCAB, tmp_path / "model", head_dim=32)
    plan_config = PlanConfig(num_ranks=1, tokens_per_rank=192, micro_batches_per_step=1, epochs=1, seed=0)
    mock = dict(num_docs=12, median_length=30, max_length=60, min_token_id=3)
    base, dataset, _ = planned_mock(
        tmp_path, VOCAB, None, plan_config, mock=mock, model=str(folder), tokenizer=None, save_grads_at_steps=(1,)
    )
    settings = dict(max_steps=1, device="cuda", dtype="bf16", compile="auto", parallel="single")
    monkeypatch.delenv("SFTFLOW_ATTENTION", raising=False)
    with caplog.at_level(logging.INFO):
        run(base, tmp_path / "fa4", **settings)
    assert "attention backend: flash_attn_4" in caplog.text
    monkeypatch.setenv("SFTFLOW_ATTENTION", "triton")
    run(base, tmp_path / "triton", **settings)
    rows = [[dataset[int(i)] for i in plan_row(load_plan(tmp_path / "plan"), 0, 0, 0)]]
    want_loss, want_grads = hf_reference(folder, rows)
    fa4_loss, triton_loss = losses(tmp_path / "fa4")[0], losses(tmp_path / "triton")[0]
    assert abs(fa4_loss - want_loss) <= 2e-2 * abs(want_loss), (fa4_loss, want_loss)
    assert abs(fa4_loss - triton_loss) <= 5e-3 * abs(triton_loss), (fa4_loss, triton_loss)
    fa4_grads = read_safetensors(tmp_path / "fa4" / "debug" / "grads-step-1.safetensors")
    triton_grads = read_safetensors(tmp_path / "triton" / "debug" / "grads-step-1.safetensors")
    for pname, want in want_grads.items():
        fa4, triton = fa4_grads[pname].float(), triton_grads[pname].float()
        assert rel_err(fa4, want) <= 1.25 * rel_err(triton, want) + 1e-2, (pname, rel_err(fa4, want))
        assert rel_err(fa4, triton) <= 2 * rel_err(triton, want) + 1e-2, (pname, rel_err(fa4, triton))
