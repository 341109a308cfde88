"""The training checks: a few real steps of the worker (torchrun, gloo, on the CPU) on the sampled documents.

    sample ──pbin──▶ index ──plan (2 ranks)──▶ run "two-ranks"   2 processes, one planned rank each
                                          ├──▶ run "one-rank"    1 process taking both ranks' rows a step
                                          └──▶ run "killed"      2 processes, SIGKILLed (launcher, torchrun, workers)
                                                                 after its first checkpoint, then resumed

- `2 ranks = 1 rank`: the two runs' step losses and final weights (relative L2 over all of them) agree within
  `check.ranks_rtol` (data parallelism and gradient accumulation sum in different orders, so not to the bit).
- `kill + resume = uninterrupted`: the killed run (`kill.kill_after_a_checkpoint`), resumed the normal way from the
  checkpoint its `latest` names, has from there on the very losses and final weights of "two-ranks", bit for bit. A
  run that ends before the kill reaches it is started again once; twice, and the row fails saying so.

Each run is the launcher sftflow trains with (`sftflow.tasks.train.launch.train`), with the run config's `train`
options (model, optimizer, LoRA, ...) but on the CPU, in fp32, with FSDP, without compiling, exporting or quantizing.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from sftflow.tasks.check.kill import Kill, kill_after_a_checkpoint
from sftflow.tasks.check.results import CheckRow
from sftflow.tasks.data.index import build_index
from sftflow.tasks.data.pbin import write_pbin
from sftflow.tasks.data.records import TokenizedDoc
from sftflow.tasks.plan.config import PlanConfig
from sftflow.tasks.plan.plan_files import plan_from_index
from sftflow.tasks.train.config import TrainConfig, TrainOptions


@dataclass(frozen=True)
class RunRecord:
    losses: dict[int, float]  # by step
    weights: dict[str, torch.Tensor]  # the model's tensors at the last step's checkpoint
    kill: Kill | None = None  # how the run was killed before it was resumed (None: a resume from step 1's checkpoint)


def _dcp_model(path: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    state = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def _record(run_dir: Path, steps: int) -> RunRecord:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    losses = {r["step"]: r["loss"] for r in map(json.loads, lines)}
    return RunRecord(losses=losses, weights=_dcp_model(run_dir / "checkpoints" / f"step-{steps}"))


def sample_plan(docs: list[TokenizedDoc], vocab_size: int, folder: Path, steps: int, seed: int) -> tuple[Path, Path]:
    """(index folder, plan folder) of `docs` planned for 2 ranks, rows as long as the longest document, over as many
    epochs as `steps` needs."""
    folder.mkdir(parents=True, exist_ok=True)
    write_pbin(folder / "sample.pbin", docs, vocab_size, provenance={"source": "sftflow check sample"})
    build_index([folder / "sample.pbin"], folder / "index", dedup=False, eval_fraction=0.0)
    longest = max(len(d.input_ids) for d in docs)
    config = PlanConfig(num_ranks=2, tokens_per_rank=longest, micro_batches_per_step=1, epochs=steps, seed=seed)
    arrays, _ = plan_from_index(folder / "index", config, folder / "plan")
    if arrays.num_steps < steps:
        raise ValueError(f"check: the sample plans to {arrays.num_steps} steps, fewer than {steps}; raise check.docs")
    return folder / "index", folder / "plan"


def run_training_checks(
    options: TrainOptions, docs: list[TokenizedDoc], vocab_size: int, tokenizer: str, folder: Path, steps: int
) -> tuple[RunRecord, RunRecord, RunRecord]:
    """The three runs (two ranks, one rank, killed and resumed), each `steps` steps, in `folder` (emptied first)."""
    from sftflow.tasks.train.launch import train

    shutil.rmtree(folder, ignore_errors=True)
    index, plan = sample_plan(docs, vocab_size, folder, steps, options.seed)
    fields = options.model_dump() | dict(
        data=str(index),
        plan=str(plan),
        tokenizer=tokenizer,
        max_steps=steps,
        checkpoint=options.checkpoint.model_copy(
            update=dict(every=1, keep_last=steps + 1, save=True, resume=False, init_from=None)
        ),
        export=False,
        device="cpu",
        memory=options.memory.model_copy(update=dict(dtype="fp32", compile="off")),
        parallel="fsdp",
        nnodes=1,
        node_rank=0,
        num_threads=1,  # the same float summation order in one process as in two
        # both are for one GPU (parallel: single)
        optimizer=options.optimizer.model_copy(update=dict(in_backward=False, offload="off")),
        quantize="none",  # nf4 needs a GPU: a QLoRA config is checked as LoRA on the fp32 base
    )
    records = {}
    for name, nproc in (("two-ranks", 2), ("one-rank", 1)):
        train(TrainConfig(**(fields | dict(nproc=nproc, out=str(folder / name)))))
        records[name] = _record(folder / name, steps)
    killed = TrainConfig(**(fields | dict(nproc=2, out=str(folder / "killed"))))
    kill = kill_after_a_checkpoint(killed)
    if kill.landed:
        train(killed, resume=True)  # the normal resume: from the checkpoint `latest` names
        records["resumed"] = replace(_record(killed.run_dir, steps), kill=kill)
    else:
        records["resumed"] = RunRecord(losses={}, weights={}, kill=kill)
    return records["two-ranks"], records["one-rank"], records["resumed"]


KILL_ROW = "kill + resume = uninterrupted"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def training_rows(two: RunRecord, one: RunRecord, resumed: RunRecord, steps: int, rtol: float) -> list[CheckRow]:
    loss_diff = max(abs(two.losses[s] - one.losses[s]) / max(abs(one.losses[s]), 1e-30) for s in range(1, steps + 1))
    # Over all the weights together: a tensor whose gradient is zero but for rounding (a k-projection bias, which
    # softmax cancels) takes Adam steps of random sign, which differ between the runs in that tensor alone.
    names = sorted(one.weights)
    weight_err = _rel(
        torch.cat([two.weights[k].flatten() for k in names]), torch.cat([one.weights[k].flatten() for k in names])
    )
    ranks = CheckRow(
        name="2 ranks = 1 rank",
        passed=bool(np.isfinite(loss_diff)) and loss_diff <= rtol and weight_err <= rtol,
        measured=f"losses rel {loss_diff:.1e}, weights rel {weight_err:.1e}",
        bound=f"<= {rtol:.0e}",
        detail=f"{steps} steps on the CPU (gloo); weights: relative L2 over all of them",
    )
    kill = resumed.kill
    if kill is not None and not kill.landed:
        resume = CheckRow(
            name=KILL_ROW,
            passed=False,
            measured="no kill landed",
            bound="bit-equal",
            detail=f"the run reached step {kill.latest} of {steps} before the kill, in {kill.attempts} attempts; "
            "raise check.steps",
        )
        return [ranks, resume]
    start = 1 if kill is None else kill.latest
    later = range(start + 1, steps + 1)
    same_losses = sum(resumed.losses.get(s) == two.losses[s] for s in later)
    same_tensors = sum(torch.equal(resumed.weights[k], two.weights[k]) for k in two.weights)
    differ = [f"step {s}: loss {resumed.losses.get(s)} resumed, {two.losses[s]} uninterrupted" for s in later]
    differ = [d for d, s in zip(differ, later, strict=True) if resumed.losses.get(s) != two.losses[s]]
    how = "" if kill is None else f"{kill.describe()}; "
    resume = CheckRow(
        name=KILL_ROW,
        passed=same_losses == len(later) and same_tensors == len(two.weights),
        measured=f"losses {same_losses}/{len(later)}, tensors {same_tensors}/{len(two.weights)} bit-equal",
        bound="bit-equal",
        detail=differ[0] if differ else f"{how}resumed from the step-{start} checkpoint to step {steps}",
    )
    return [ranks, resume]
