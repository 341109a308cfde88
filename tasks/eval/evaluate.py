"""evaluate: held-out masked loss, perplexity, token accuracy and greedy generation checks, base vs tuned.

Metrics run document by document (the `iterative` plan mode): the model's own dense causal attention on one
unpadded document at a time, so there is no packing and nothing to isolate. Loss and accuracy count exactly the
tokens training trains: targets inside a loss span, never a document's first token.

Generation checks use each document's *last* trained span as the reference answer and everything before it as the
prompt, so they work for any record format and template. Generation is Hugging Face `generate` with its KV cache and
dense attention, not the packed varlen path used in training.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from sftflow.tasks.core.manifests import EvalMetrics, SourceMetrics


@dataclass
class Example:
    prompt: str
    reference: str
    outputs: dict[str, str] = field(default_factory=dict)


def _targets(ids: np.ndarray, spans: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and pre-shifted labels: label[t] = ids[t+1] when token t+1 is in a loss span, else -100."""
    mask = np.zeros(len(ids), dtype=bool)
    for start, end in np.asarray(spans).reshape(-1, 2):
        mask[start:end] = True
    labels = np.full(len(ids), -100, dtype=np.int64)
    labels[:-1] = np.where(mask[1:], ids[1:], -100)
    return torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(labels)


@torch.no_grad()
def masked_metrics(
    model,
    docs: Sequence[tuple[np.ndarray, np.ndarray]],
    sources: Sequence[str] | None = None,
    tags: Sequence[str] | None = None,
) -> EvalMetrics:
    """Masked loss and token accuracy over `docs`; with `sources` (each document's data source) also per source, and
    with `tags` (each document's tag) per tag."""
    model.eval()
    device = next(model.parameters()).device
    per_doc: list[tuple[int, float, int, int]] = []  # (document, loss sum, correct, count) of documents with targets
    for i, (ids, spans) in enumerate(docs):
        input_ids, labels = _targets(np.asarray(ids), spans)
        keep = labels != -100
        if not keep.any():
            continue
        logits = model(input_ids=input_ids[None].to(device)).logits[0].float()
        target = labels.to(device)[keep.to(device)]
        picked = logits[keep.to(device)]
        loss_sum = torch.nn.functional.cross_entropy(picked, target, reduction="sum").item()
        per_doc.append((i, loss_sum, int((picked.argmax(-1) == target).sum()), int(keep.sum())))
    loss_sum, correct, count = (sum(row[k] for row in per_doc) for k in (1, 2, 3))
    if count == 0:
        raise ValueError("the eval split has no trained tokens: nothing to evaluate")
    loss = loss_sum / count
    return EvalMetrics(
        loss=loss,
        perplexity=math.exp(min(loss, 50.0)),
        token_accuracy=correct / count,
        loss_tokens=count,
        by_source=_grouped(per_doc, sources),
        by_tag=_grouped(per_doc, tags),
    )


def _grouped(per_doc: list[tuple[int, float, int, int]], keys: Sequence[str] | None) -> dict[str, SourceMetrics]:
    """The per-document sums added up by each document's key (its source, or its tag), as metrics per key."""
    if keys is None:
        return {}
    sums: dict[str, list[float]] = {}  # key -> [loss sum, correct, count, docs]
    for i, loss_sum, correct, count in per_doc:
        row = sums.setdefault(keys[i], [0.0, 0, 0, 0])
        row[0] += loss_sum
        row[1] += correct
        row[2] += count
        row[3] += 1
    return {
        name: SourceMetrics(loss=r[0] / r[2], token_accuracy=r[1] / r[2], loss_tokens=r[2], docs=r[3])
        for name, r in sorted(sums.items())
    }


def prompt_and_reference(ids: np.ndarray, spans: np.ndarray, eos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Split a document at its last trained span: (prompt ids, reference ids without a trailing EOS)."""
    spans = np.asarray(spans).reshape(-1, 2)
    if len(spans) == 0:
        raise ValueError("document has no trained span")
    start, end = int(spans[-1, 0]), int(spans[-1, 1])
    reference = np.asarray(ids[start:end])
    if eos_id is not None and len(reference) and reference[-1] == eos_id:
        reference = reference[:-1]
    return np.asarray(ids[:start]), reference


def overlap_score(a: str, b: str) -> float:
    """Character-level similarity in [0, 1] (difflib's ratio); 1.0 means identical."""
    return difflib.SequenceMatcher(a=a, b=b, autojunk=False).ratio()


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: Sequence[np.ndarray], max_new_tokens: Sequence[int]) -> list[str]:
    model.eval()
    device = next(model.parameters()).device
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    answers = []
    for prompt, budget in zip(prompts, max_new_tokens, strict=True):
        input_ids = torch.as_tensor(prompt, dtype=torch.long)[None].to(device)
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=int(budget),
            do_sample=False,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
        )
        new = out[0, input_ids.shape[1] :].tolist()
        if eos_id in new:
            new = new[: new.index(eos_id)]
        answers.append(tokenizer.decode(new, skip_special_tokens=True).strip())
    return answers


@dataclass
class EvalResult:
    metrics: dict[str, EvalMetrics]
    examples: list[Example]

    def to_json(self) -> dict:
        return {
            "metrics": {k: v.model_dump() for k, v in self.metrics.items()},
            "examples": [asdict(e) for e in self.examples],
        }


def evaluate_models(
    models: dict[str, torch.nn.Module],
    tokenizer,
    docs: Sequence[tuple[np.ndarray, np.ndarray]],
    max_generations: int = 64,
    num_examples: int = 4,
    sources: Sequence[str] | None = None,
    tags: Sequence[str] | None = None,
) -> EvalResult:
    """Masked metrics for every model on `docs` (per data source and per tag too, given each document's `sources` and
    `tags`), plus greedy generation on the first `max_generations` docs."""
    eos_id = tokenizer.eos_token_id
    gen_docs = [d for d in docs if len(np.asarray(d[1]).reshape(-1, 2))][:max_generations]
    splits = [prompt_and_reference(np.asarray(ids), spans, eos_id) for ids, spans in gen_docs]
    prompts = [p for p, _ in splits]
    references = [tokenizer.decode(r.tolist(), skip_special_tokens=True).strip() for _, r in splits]
    budgets = [len(r) + 8 for _, r in splits]
    examples = [
        Example(prompt=tokenizer.decode(p.tolist(), skip_special_tokens=False), reference=ref)
        for p, ref in list(zip(prompts, references, strict=True))[:num_examples]
    ]
    metrics = {}
    for name, model in models.items():
        base = masked_metrics(model, docs, sources, tags)
        if prompts:
            answers = greedy_answers(model, tokenizer, prompts, budgets)
            exact = float(np.mean([a == r for a, r in zip(answers, references, strict=True)]))
            overlap = float(np.mean([overlap_score(a, r) for a, r in zip(answers, references, strict=True)]))
            for example, answer in zip(examples, answers, strict=False):
                example.outputs[name] = answer
            base = base.model_copy(update={"exact_match": exact, "overlap": overlap, "generations": len(prompts)})
        metrics[name] = base
    return EvalResult(metrics=metrics, examples=examples)
