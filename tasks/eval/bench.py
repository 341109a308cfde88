"""Scoring models on benchmark tasks: exact match of extracted answers, and multiple choice by log-likelihood.

Every model sees the same prompts (rendered once, with the data's chat template), tokenized without added special
tokens, as the training data is: the template writes the ones it needs.

    generate: prompt ids ─ greedy decode (stop at EOS, at most max_new_tokens) ─ answer_pattern ─┐
              item answer ─────────────────────────────────────────────── reference_pattern ─┴─ equal? → exact_match
    choice:   for each choice c: sum log p(c's tokens | prompt ids) ─ argmax ─ the right one? → accuracy

A choice's tokens are its text tokenized alone, appended to the prompt's ids, so every choice is scored after
exactly the same context.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from sftflow.tasks.data.chat_template import ChatTemplate
from sftflow.tasks.eval.bench_config import BenchTask, BenchTaskFile
from sftflow.tasks.eval.bench_items import BenchItem, read_items, render_prompt, split_items
from sftflow.tasks.eval.bench_result import TaskResult
from sftflow.tasks.eval.evaluate import greedy_answers

METRIC = {"generate": "exact_match", "choice": "accuracy"}


def extract(text: str, pattern: str | None) -> str | None:
    """The last match of `pattern` in `text` (its first group where it has one), stripped; the whole stripped text
    without a pattern; None where the pattern does not match."""
    if pattern is None:
        return text.strip()
    matches = list(re.finditer(pattern, text))
    if not matches:
        return None
    last = matches[-1]
    return (last.group(1) if last.re.groups else last.group(0)).strip()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def choice_loglikelihoods(model, context: Sequence[int], continuations: Sequence[Sequence[int]]) -> list[float]:
    """Sum of log p(continuation token | everything before it) for each continuation after `context`."""
    model.eval()
    device = next(model.parameters()).device
    scores = []
    for continuation in continuations:
        ids = torch.as_tensor([*context, *continuation], dtype=torch.long, device=device)
        logits = model(input_ids=ids[None]).logits[0].float()
        # The logits at position t predict token t+1: the continuation's tokens are predicted from len(context)-1 on.
        predicting = logits[len(context) - 1 : -1]
        logprobs = torch.log_softmax(predicting, dim=-1)
        target = ids[len(context) :]
        scores.append(float(logprobs.gather(1, target[:, None]).sum()))
    return scores


def score_task(
    models: dict[str, torch.nn.Module], tokenizer, template: ChatTemplate | None, task_file: BenchTaskFile
) -> TaskResult:
    task = task_file.task
    fewshot, items = split_items(read_items(task_file.path, task), task)
    prompts = [render_prompt(item, fewshot, template if task.chat else None) for item in items]
    contexts = [encode(tokenizer, p) for p in prompts]
    samples = [{"line": item.line, "reference": item.answer} for item in items]
    scores, verdicts = {}, {}
    for name, model in models.items():
        verdicts[name] = (
            _generate(model, tokenizer, task, items, contexts, samples, name)
            if task.kind == "generate"
            else _choose(model, tokenizer, items, contexts, samples, name)
        )
        scores[name] = sum(verdicts[name]) / len(verdicts[name])
    return TaskResult(
        name=task.name,
        kind=task.kind,
        metric=METRIC[task.kind],
        scores=scores,
        items=len(items),
        prompt_example=prompts[0],
        samples=samples,
        subsets=subset_scores(items, verdicts),
    )


def subset_scores(items: list[BenchItem], verdicts: dict[str, list[bool]]) -> dict[str, dict]:
    """Per subset (sorted; items without one under "other"): its item count and each model's score. Empty where no
    item names a subset."""
    if all(item.subset is None for item in items):
        return {}
    groups: dict[str, list[int]] = {}
    for k, item in enumerate(items):
        groups.setdefault(item.subset or "other", []).append(k)
    return {
        subset: {
            "items": len(ks),
            "scores": {name: sum(v[k] for k in ks) / len(ks) for name, v in verdicts.items()},
        }
        for subset, ks in sorted(groups.items())
    }


def _generate(model, tokenizer, task: BenchTask, items: list[BenchItem], contexts, samples, name: str) -> list[bool]:
    outputs = greedy_answers(model, tokenizer, contexts, [task.max_new_tokens] * len(contexts))
    verdicts = []
    for item, output, sample in zip(items, outputs, samples, strict=True):
        reference = extract(item.answer, task.reference_pattern)
        answer = extract(output, task.answer_pattern)
        ok = reference is not None and answer == reference
        sample[name] = {"output": output, "answer": answer, "correct": ok}
        verdicts.append(ok)
    return verdicts


def _choose(model, tokenizer, items: list[BenchItem], contexts, samples, name: str) -> list[bool]:
    verdicts = []
    for item, context, sample in zip(items, contexts, samples, strict=True):
        loglik = choice_loglikelihoods(model, context, [encode(tokenizer, c) for c in item.choices])
        pick = max(range(len(loglik)), key=loglik.__getitem__)
        ok = pick == item.correct_choice
        sample[name] = {"choice": item.choices[pick], "loglikelihoods": loglik, "correct": ok}
        verdicts.append(ok)
    return verdicts


def run_bench(
    models: dict[str, torch.nn.Module], tokenizer, template: ChatTemplate | None, task_files: Sequence[BenchTaskFile]
) -> list[TaskResult]:
    return [score_task(models, tokenizer, template, f) for f in task_files]
