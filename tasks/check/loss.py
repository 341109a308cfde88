"""The loss check: sftflow's first step on a packed row of the sampled documents equals Hugging Face's own `eager`
forward over each document alone, in loss and in every parameter's gradient.

    sftflow   build_training_model(model) ── packed row [doc 0 | doc 1 | doc 2] ── CausalLMLoss ── sum / targets
    HF        from_pretrained(model, attn_implementation="eager") ── doc 0, doc 1, doc 2 alone ── CE sum / targets

Both in fp32 on one device. sftflow's side is the model the worker trains (read shard by shard from the folder's
safetensors, embeddings grown for tokens the template added, the varlen attention with each layer's window); the
reference reads the folder through transformers as anyone would. A preset or a config.json has no weights: the
reference is built from the same config and given sftflow's random weights. Where the model's forward adds a
router loss (Qwen3-MoE), the reference adds the model's own `load_balancing_loss_func` over the row's tokens, as
one forward of the row computes it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sftflow.tasks.check.results import CheckRow
from sftflow.tasks.data.records import TokenizedDoc
from sftflow.tasks.train.collate import collate, packed_collator, padded_collator
from sftflow.tasks.train.families import router_aux_loss_coef
from sftflow.tasks.train.model import PRESETS, CausalLMLoss, build_training_model, model_batch
from sftflow.tasks.train.weights import grow_vocabulary, materialize


@dataclass(frozen=True)
class LossComparison:
    loss: float
    reference_loss: float
    loss_rel_err: float
    grad_rel_err: float  # the largest over parameters
    worst_parameter: str
    parameters: int
    targets: int
    docs: int


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _targets(doc: TokenizedDoc) -> list[int]:
    """Positions t whose next token is trained (t + 1 in a loss span)."""
    trained = doc.loss_mask().astype(bool)
    return [t for t in range(len(doc.input_ids) - 1) if trained[t + 1]]


def _reference_model(spec: str, lm, vocab_size: int, overrides: dict, device: torch.device):
    from transformers import AutoModelForCausalLM

    if spec in PRESETS or (spec.endswith(".json") and Path(spec).is_file()):
        config = type(lm.config).from_dict(lm.config.to_dict())
        ref = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
        ref.load_state_dict(lm.state_dict())
    else:
        ref = AutoModelForCausalLM.from_pretrained(spec, attn_implementation="eager", dtype=torch.float32, **overrides)
        if ref.config.vocab_size < vocab_size:
            grow_vocabulary(ref, vocab_size)
    return ref.to(device)


def hf_eager_reference(ref, docs: list[TokenizedDoc]) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, gradients on the CPU by parameter name) of one step over `docs` as one row, each document through the
    model's own forward alone. Without a router loss each document's backward runs as soon as its forward has, so
    only one document's activations are held at a time."""
    device = next(ref.parameters()).device
    coef = router_aux_loss_coef(ref.config)
    count = sum(len(_targets(d)) for d in docs)
    router_logits, ce_total = [], 0.0
    for doc in docs:
        ids = torch.as_tensor(doc.input_ids, device=device)[None]
        out = ref(input_ids=ids, use_cache=False, output_router_logits=coef is not None)
        positions = _targets(doc)
        ce = out.logits.new_zeros(())
        if positions:
            targets = ids[0, torch.as_tensor(positions, device=device) + 1]
            ce = torch.nn.functional.cross_entropy(out.logits[0, positions].float(), targets, reduction="sum")
        if coef is None:
            (ce / count).backward()
            ce_total += ce.item()
        else:
            router_logits.append(out.router_logits)
            ce_total = ce_total + ce
    if coef is not None:
        balance = sys.modules[type(ref).__module__].load_balancing_loss_func
        layers = tuple(torch.cat([d[i] for d in router_logits]) for i in range(len(router_logits[0])))
        aux = balance(layers, ref.config.num_experts, ref.config.num_experts_per_tok, None)
        loss = (ce_total + coef * aux * count) / count
        loss.backward()
        loss_value = loss.item()
    else:
        loss_value = ce_total / count
    grads = {name: p.grad.detach().to("cpu") for name, p in ref.named_parameters() if p.grad is not None}
    return loss_value, grads


def row_docs(docs: list[TokenizedDoc], max_tokens: int) -> tuple[list[TokenizedDoc], int]:
    """The documents that fit one row of `max_tokens`, in order, and how many were left out."""
    kept, used = [], 0
    for doc in docs:
        if used + len(doc.input_ids) <= max_tokens:
            kept.append(doc)
            used += len(doc.input_ids)
    return kept, len(docs) - len(kept)


def compare_first_step(
    spec: str,
    docs: list[TokenizedDoc],
    *,
    vocab_size: int,
    device: torch.device,
    overrides: dict | None = None,
    seed: int = 0,
    packed: bool = True,
) -> LossComparison:
    """sftflow's loss and gradients of one step on `docs` (one packed row, or a padded micro-batch) against
    `hf_eager_reference` on the same weights."""
    overrides = dict(overrides or {})
    torch.manual_seed(seed)
    lm, files = build_training_model(spec, vocab_size=vocab_size, packed=packed, overrides=overrides, device=device)
    if files is not None:
        materialize(lm, lm, device, files, seed=seed)
    lm = lm.to(device)
    ref = _reference_model(spec, lm, vocab_size, overrides, device)
    want_loss, want_grads = hf_eager_reference(ref, docs)
    del ref
    batch = collate([(d.input_ids, d.loss_spans_S2) for d in docs], packed_collator() if packed else padded_collator())
    model = CausalLMLoss(lm)
    loss = model(**model_batch(batch, device, vocab_size)) / int(batch["num_loss_tokens"])
    loss.backward()
    got_grads = {name: p.grad.detach().to("cpu") for name, p in lm.named_parameters() if p.grad is not None}
    missing = sorted(want_grads.keys() ^ got_grads.keys())
    if missing:
        raise ValueError(f"model {spec}: parameters with a gradient on one side only: {missing[:4]}")
    errors = {name: _rel_err(got_grads[name], want) for name, want in want_grads.items()}
    worst = max(errors, key=errors.get)
    return LossComparison(
        loss=loss.item(),
        reference_loss=want_loss,
        loss_rel_err=abs(loss.item() - want_loss) / max(abs(want_loss), 1e-30),
        grad_rel_err=errors[worst],
        worst_parameter=worst,
        parameters=len(errors),
        targets=int(batch["num_loss_tokens"]),
        docs=len(docs),
    )


def loss_rows(result: LossComparison, loss_rtol: float, grad_rtol: float, left_out: int, mode: str) -> list[CheckRow]:
    where = f"{result.docs} docs, {result.targets} trained targets, {mode} row"
    if left_out:
        where += f"; {left_out} sampled doc(s) past check.max_tokens left out"
    loss = CheckRow(
        name="first-step loss = HF eager",
        passed=bool(np.isfinite(result.loss)) and result.loss_rel_err <= loss_rtol,
        measured=f"rel {result.loss_rel_err:.1e} ({result.loss:.6f} vs {result.reference_loss:.6f})",
        bound=f"<= {loss_rtol:.0e}",
        detail=where,
    )
    grads = CheckRow(
        name="first-step grads = HF eager",
        passed=result.grad_rel_err <= grad_rtol,
        measured=f"max rel {result.grad_rel_err:.1e} over {result.parameters} params",
        bound=f"<= {grad_rtol:.0e}",
        detail=f"worst: {result.worst_parameter}",
    )
    return [loss, grads]
