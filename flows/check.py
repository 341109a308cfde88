"""`sft-check`: the correctness checks a user runs on their own model and data, before training.

    config ──▶ sample: first records of each source, rendered and tokenized as the data stages do
                 ├─▶ ids and masks = HF apply_chat_template(..., return_assistant_tokens_mask=True)
                 ├─▶ ids = the model's own template (when the data is rendered with another one)
                 ├─▶ one stop per trained turn
                 ├─▶ first-step loss and gradients of a packed row = HF eager forward per document
                 └─▶ a few steps: 2 ranks = 1 rank; killed (SIGKILL) and resumed = uninterrupted (torchrun, gloo)

`run_checks` is the plain function (the CLI calls it); the flow wraps it for deployments, publishes the table as an
artifact, and fails when a check fails, so a deployment can gate training on it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from prefect import flow

from sftflow.flows.config import SFTConfig, data_config, resolve_config
from sftflow.tasks.check.loss import compare_first_step, loss_rows, row_docs
from sftflow.tasks.check.results import CheckReport, CheckRow
from sftflow.tasks.check.sample import sample_docs, sample_records
from sftflow.tasks.check.template import ids_and_masks_match_hf, ids_match_own_template, one_stop_per_trained_turn


class ChecksFailed(RuntimeError):
    """At least one check failed: the flow run ends Failed, with the table."""


def check_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("check.device: 'cuda' asked for, and torch sees no GPU here; use 'auto' or 'cpu'")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def run_checks(cfg: SFTConfig) -> CheckReport:
    """Every check on `cfg`'s data (a sample of it) and model. Bad input raises `ValueError` naming what is wrong."""
    from transformers import AutoTokenizer

    from sftflow.flows.data import local_path
    from sftflow.tasks.data.render import resolve_template
    from sftflow.tasks.data.stage import tokenizer_ref, with_template_tokens

    work = Path(cfg.work_dir).resolve()
    data = data_config(cfg)
    tokenizer_files = with_template_tokens(data.render, tokenizer_ref(data.tokenizer, work), work)
    template = resolve_template(data.render, tokenizer_files.path)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_files.path)
    logger = logging.getLogger("sftflow.check")
    paths = [local_path(spec, work, logger) for spec in data.source_specs]
    records = sample_records(paths, cfg.check.docs, data.render)
    docs = sample_docs(records, template, tokenizer, data.render, data.spans)
    if not docs:
        raise ValueError(f"data.sources: no record to check in the first {cfg.check.docs} of {', '.join(paths)}")

    rows: list[CheckRow] = []
    if template is not None:
        rows.append(ids_and_masks_match_hf(docs, tokenizer, template, data.render.mask_policy))
        own = ids_match_own_template(docs, tokenizer, template)
        if own is not None:
            rows.append(own)
    rows.append(one_stop_per_trained_turn(docs, tokenizer))

    trained = [d.trained for d in docs if d.trained is not None]
    kept, left_out = row_docs(trained, cfg.check.max_tokens)
    if not kept:
        raise ValueError(f"check.max_tokens={cfg.check.max_tokens}: no sampled document fits; raise it")
    packed = cfg.plan.mode == "packed"
    result = compare_first_step(
        cfg.train.model,
        kept,
        vocab_size=len(tokenizer),
        device=check_device(cfg.check.device),
        overrides=cfg.train.model_overrides,
        seed=cfg.train.seed,
        packed=packed,
    )
    rows += loss_rows(result, cfg.check.loss_rtol, cfg.check.grad_rtol, left_out, "packed" if packed else "padded")
    if cfg.check.steps:
        from sftflow.tasks.check.training import run_training_checks, training_rows

        runs = run_training_checks(
            cfg.train, trained, len(tokenizer), tokenizer_files.path, work / "check", cfg.check.steps
        )
        rows += training_rows(*runs, cfg.check.steps, cfg.check.ranks_rtol)
    return CheckReport(rows=rows)


@flow(name="sft-check", log_prints=True)
def sft_check(
    config_path: str | None = None, config: SFTConfig | None = None, overrides: dict[str, Any] | None = None
) -> CheckReport:
    """Check the data's tokens and masks against Hugging Face, the first training step against Hugging Face's eager
    forward, 2 ranks against 1 and a killed and resumed run against an unbroken one, on a sample of the data and the
    configured model; fail when a check fails."""
    from prefect.artifacts import create_markdown_artifact

    report = run_checks(resolve_config(config_path, config, overrides))
    print(report.table())
    create_markdown_artifact(report.markdown(), key="sft-check", description="sft-check: correctness checks")
    if not report.passed:
        raise ChecksFailed(report.table())
    return report
