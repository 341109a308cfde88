"""`sftflow` command line: each command runs one flow (or the whole `sft` flow) in-process.

User errors (bad input, bad config) end with a one-line message naming the file, record and field, and exit code 2;
no traceback.
"""

from __future__ import annotations

import json
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Supervised fine-tuning as a Prefect pipeline.")

# One word for what an option takes, in place of a type tag: a flag takes nothing, choices are listed instead.
_METAVARS = {"path": "PATH", "int": "N", "float": "X", "str": "TEXT"}
_CHOICES = re.compile(r"^(\w+(?:\|\w+)+)(?::\s*(.*))?$")


class _Command(TyperCommand):
    """Help that reads as usage: `--mask-policy generation|roles`, `--max-steps N`, `--force` alone, and options a
    command cannot run without (unless a config file gives them) marked."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for param in self.params:
            if param.param_type_name != "option":
                continue
            if param.is_flag:
                param.metavar = ""
                continue
            choices = _CHOICES.match(param.help or "")
            if choices:
                param.metavar, param.help = choices.group(1), choices.group(2) or ""
            elif param.metavar is None:
                kind = param.display_type(None).strip("<>").removeprefix("list[").removesuffix("]")
                param.metavar = _METAVARS.get(kind, kind.upper())
            if param.multiple:
                param.help = f"{param.help} (repeat for more)".strip()

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option


def command(name: str | None = None):
    return app.command(name, cls=_Command)


def _quiet_defaults() -> None:
    # Offline by default: no analytics, no hub look-ups unless the user asks for a hub model.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@app.callback()
def _options(
    debug: Annotated[bool, typer.Option("--debug", help="print tracebacks on the terminal")] = False,
) -> None:
    from sftflow.flows.console import set_debug

    set_debug(debug)


def _fail(message: str, code: int = 2) -> None:
    from sftflow.flows.console import log_file

    where = log_file()
    details = f" (details: {where})" if where is not None else ""
    typer.secho(f"error: {message}{details}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=code)


def _user_errors(fn):
    """Turn bad input into one located line instead of a traceback."""
    import functools

    from pydantic import BaseModel, ValidationError

    from sftflow.flows.local_api import LocalAPIError
    from sftflow.tasks.train.errors import TrainingFailed

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValidationError as err:
            from sftflow.flows.config import explain_validation_error, validated_models

            _fail(f"config: {explain_validation_error(err, validated_models().get(err.title, BaseModel))}")
        except (ValueError, FileNotFoundError, LocalAPIError) as err:
            _fail(str(err).splitlines()[0] if str(err) else type(err).__name__)
        except TrainingFailed as err:  # a crash, not bad input: one line too, with the log above it
            _fail(str(err), code=1)

    return wrapper


def _notice(message: str) -> None:
    typer.secho(message, err=True, fg=typer.colors.BLUE)


@contextmanager
def _flow_session(work_dir: str | Path):
    """What a command that runs flows holds while they run: the work folder's lock (taken first, so a busy folder is
    refused at once, without a Prefect API), the Prefect API (`sftflow.flows.local_api`), and a log of the runs in
    the work folder that keeps tracebacks off the terminal (`sftflow.flows.console`)."""
    from sftflow.flows.console import logged_to
    from sftflow.flows.local_api import prefect_api
    from sftflow.flows.results import work_dir_lock

    work = Path(work_dir).resolve()
    with work_dir_lock(work), prefect_api(notice=_notice), logged_to(work):
        yield


def _load_yaml(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    import yaml

    if not path.is_file():
        raise ValueError(f"{path}: config file not found")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: config must be a mapping at the top level")
    return data


def _set(section: dict, key: str, value: Any) -> None:
    if value is not None:
        section[key] = value


@command()
@_user_errors
def data(
    source: Annotated[
        list[str] | None,
        typer.Option("--source", help="JSONL/Parquet file or datasets folder (required without --config)"),
    ] = None,
    tokenizer: Annotated[
        str | None, typer.Option(help="tokenizer folder or hub id (required without --config)")
    ] = None,
    template: Annotated[str | None, typer.Option(help="built-in name (chatml, llama3) or .jinja file")] = None,
    format: Annotated[
        str | None, typer.Option(help="auto|messages|sharegpt|prompt_completion|alpaca|text_spans")
    ] = None,
    mask_policy: Annotated[str | None, typer.Option(help="generation|roles")] = None,
    bos: Annotated[str | None, typer.Option(help="auto|never")] = None,
    eos: Annotated[str | None, typer.Option(help="auto|always|never")] = None,
    max_length: Annotated[int | None, typer.Option(help="longest document in tokens")] = None,
    length_policy: Annotated[str | None, typer.Option(help="drop|truncate")] = None,
    tokenizer_backend: Annotated[
        str | None, typer.Option(help="auto|hf|tiktoken: who tokenizes in spans (auto: tiktoken when exact)")
    ] = None,
    on_bad_record: Annotated[str | None, typer.Option(help="error|reject")] = None,
    eval_fraction: Annotated[float | None, typer.Option(help="share of documents held out for evaluation")] = None,
    task_runner: Annotated[str | None, typer.Option(help="threads|processes|dask")] = None,
    workers: Annotated[int | None, typer.Option(help="task-runner workers")] = None,
    dask_address: Annotated[str | None, typer.Option(help="scheduler of an existing Dask cluster")] = None,
    shard_bytes: Annotated[int | None, typer.Option(help="split sources into shards of about N bytes")] = None,
    shard_records: Annotated[int | None, typer.Option(help="split sources into shards of N records")] = None,
    force: Annotated[bool, typer.Option(help="recompute every stage, ignoring the cache")] = False,
    config: Annotated[Path | None, typer.Option(help="YAML file with the same fields (DataConfig)")] = None,
    out: Annotated[Path, typer.Option(help="output folder: shards, index, manifests")] = Path("sftflow-out/data"),
) -> None:
    """Render, tokenize and pack conversations into pbin shards plus a dataset index (the `sft-data` flow)."""
    _quiet_defaults()
    from sftflow.flows.data import DataConfig, run_data

    raw = _load_yaml(config)
    raw.setdefault("render", {})
    raw.setdefault("spans", {})
    raw.setdefault("index", {})
    if source:
        raw["sources"] = source
    _set(raw, "tokenizer", tokenizer)
    for key, value in dict(task_runner=task_runner, workers=workers, dask_address=dask_address).items():
        _set(raw, key, value)
    _set(raw, "shard_bytes", shard_bytes)
    _set(raw, "shard_records", shard_records)
    for key, value in dict(
        template=template, format=format, mask_policy=mask_policy, on_bad_record=on_bad_record
    ).items():
        _set(raw["render"], key, value)
    spans = dict(
        bos=bos, eos=eos, max_length=max_length, length_policy=length_policy, tokenizer_backend=tokenizer_backend
    )
    for key, value in spans.items():
        _set(raw["spans"], key, value)
    _set(raw["index"], "eval_fraction", eval_fraction)
    if max_length is not None:
        raw["index"].setdefault("max_length", max_length)
    if "sources" not in raw or "tokenizer" not in raw:
        raise ValueError("--source and --tokenizer are required (or set `sources` and `tokenizer` in --config)")
    data_config = DataConfig.model_validate(raw)
    with _flow_session(out):
        result = run_data(data_config, str(out), force=force)
    typer.echo(json.dumps(result.summary(), indent=2))


@command()
@_user_errors
def inspect(
    path: Annotated[Path, typer.Argument(help="a .pbin file, or a folder written by `sftflow data`")],
    num_docs: Annotated[int, typer.Option("--num-docs", "-n", help="documents to show")] = 3,
    format: Annotated[str, typer.Option(help="text|jsonl")] = "text",
    tokenizer: Annotated[str | None, typer.Option(help="tokenizer to decode with (default: the data's)")] = None,
) -> None:
    """Show documents with trained tokens highlighted, and overall statistics."""
    from sftflow.flows.inspect import inspect_path

    inspect_path(path, num_docs=num_docs, fmt=format, tokenizer=tokenizer, echo=typer.echo)


@command()
@_user_errors
def plan(
    data: Annotated[Path | None, typer.Option(help="folder written by `sftflow data`")] = None,
    lengths: Annotated[Path | None, typer.Option(help=".npy of document lengths (capacity planning)")] = None,
    num_ranks: Annotated[int, typer.Option(help="data-parallel ranks")] = 1,
    tokens_per_rank: Annotated[int, typer.Option(help="capacity of one packed row")] = 2048,  # plan's default
    micro_batches_per_step: Annotated[int | None, typer.Option(help="micro-batches per optimizer step")] = None,
    target_tokens_per_step: Annotated[int | None, typer.Option(help="trainable tokens per step (instead)")] = None,
    epochs: Annotated[int, typer.Option()] = 1,
    seed: Annotated[int, typer.Option()] = 0,
    mode: Annotated[str, typer.Option(help="packed|padded|iterative")] = "packed",
    drop_last: Annotated[bool, typer.Option(help="drop the final partial step")] = False,
    out: Annotated[Path, typer.Option(help="output folder for plan.npz")] = Path("sftflow-out/plan"),
    stats: Annotated[bool, typer.Option("--stats", help="print the plan statistics")] = False,
    stats_json: Annotated[bool, typer.Option("--stats-json", help="print one JSON object of statistics")] = False,
) -> None:
    """Plan every step × micro-batch × rank up front (the `sft-plan` flow, or plain planning with --lengths)."""
    _quiet_defaults()
    import numpy as np

    from sftflow.tasks.atomic import write_atomic
    from sftflow.tasks.plan import PlanConfig, save_plan
    from sftflow.tasks.plan import plan as make_plan

    config = PlanConfig(
        num_ranks=num_ranks,
        tokens_per_rank=tokens_per_rank,
        micro_batches_per_step=micro_batches_per_step,
        target_tokens_per_step=target_tokens_per_step,
        epochs=epochs,
        seed=seed,
        mode=mode,
        drop_last=drop_last,
    )
    if (data is None) == (lengths is None):
        raise ValueError("give exactly one of --data DIR or --lengths FILE.npy")
    if lengths is not None:
        doc_lengths = np.load(lengths, allow_pickle=False)
        if doc_lengths.ndim != 1:
            raise ValueError(f"{lengths}: expected a 1-D array of lengths, got shape {doc_lengths.shape}")
        # Without loss spans, every token but each document's first is a trained target.
        arrays, plan_stats = make_plan(doc_lengths, np.maximum(doc_lengths - 1, 0), config)
        out.mkdir(parents=True, exist_ok=True)
        save_plan(arrays, out / "plan.npz")
        write_atomic(out / "stats.json", plan_stats.model_dump_json(indent=2))
    else:
        import shutil

        from sftflow.flows.config import PlanSection, SFTConfig
        from sftflow.flows.data import load_data_result
        from sftflow.flows.plan import sft_plan

        section = PlanSection.model_validate(config.model_dump(include=set(PlanSection.model_fields)))
        cfg = SFTConfig(work_dir=str(out.resolve()), plan=section)
        with _flow_session(out):
            manifest = sft_plan(config=cfg, data=load_data_result(data))
        plan_stats = manifest.stats
        shutil.copyfile(manifest.path, out / "plan.npz")
    summary = {
        "efficiency": plan_stats.efficiency,
        "token_imbalance": plan_stats.token_imbalance,
        "cost_imbalance": plan_stats.cost_imbalance,
        "num_steps": plan_stats.num_steps,
        "num_rows": plan_stats.num_rows,
        "planning_seconds": plan_stats.planning_seconds,
        "dropped_docs": plan_stats.dropped_docs,
    }
    if stats_json:
        typer.echo(json.dumps(summary))
    elif stats:
        typer.echo(plan_stats.model_dump_json(indent=2))
    else:
        typer.echo(f"plan: {plan_stats.num_steps} steps, efficiency {plan_stats.efficiency:.2%} → {out}")


def main() -> None:  # pragma: no cover
    app(sys.argv[1:])


@command()
@_user_errors
def train(
    data: Annotated[
        Path | None,
        typer.Option(help="folder written by `sftflow data` (or a dataset index folder) (required without --config)"),
    ] = None,
    plan: Annotated[Path, typer.Option(help="folder holding plan.npz (`sftflow plan --out`)")] = Path(
        "sftflow-out/plan"
    ),
    model: Annotated[str, typer.Option(help="local folder, hub id, config.json or preset (tiny-llama)")] = "tiny-llama",
    out: Annotated[Path, typer.Option(help="run directory")] = Path("sftflow-out/run"),
    nproc: Annotated[int, typer.Option(help="worker processes (GPUs) per node")] = 1,
    max_steps: Annotated[int | None, typer.Option(help="stop after N optimizer steps")] = None,
    checkpoint_every: Annotated[int | None, typer.Option(help="save a checkpoint every N steps")] = None,
    keep_last: Annotated[int | None, typer.Option(help="checkpoints to keep")] = None,
    lr: Annotated[float | None, typer.Option(help="peak learning rate")] = None,
    seed: Annotated[int | None, typer.Option()] = None,
    resume: Annotated[bool, typer.Option(help="continue from the run's latest checkpoint")] = False,
    init_from: Annotated[str | None, typer.Option(help="checkpoint (step-N folder or run dir) to start from")] = None,
    load_components: Annotated[str | None, typer.Option(help="model[,optimizer,lr_scheduler,progress]")] = None,
    nnodes: Annotated[int | None, typer.Option(help="nodes (multi-node: same command on each)")] = None,
    node_rank: Annotated[int | None, typer.Option(help="this node's rank")] = None,
    rdzv_endpoint: Annotated[str | None, typer.Option(help="host:port of the c10d rendezvous")] = None,
    rdzv_id: Annotated[str | None, typer.Option(help="rendezvous id shared by all nodes")] = None,
    compile: Annotated[str | None, typer.Option(help="auto|off|layers: torch.compile each decoder layer")] = None,
    parallel: Annotated[
        str | None, typer.Option(help="auto|fsdp|single: FSDP2, or one device without sharding (auto: single on 1 GPU)")
    ] = None,
    lora_rank: Annotated[int | None, typer.Option(help="train LoRA adapters of this rank on a frozen base")] = None,
    lora_alpha: Annotated[float | None, typer.Option(help="LoRA alpha (default: twice the rank)")] = None,
    lora_dropout: Annotated[float | None, typer.Option(help="LoRA dropout")] = None,
    lora_targets: Annotated[str | None, typer.Option(help="all-linear, or module names: q_proj,v_proj")] = None,
    config: Annotated[Path | None, typer.Option(help="YAML with TrainConfig fields")] = None,
) -> None:
    """Train with torchrun (FSDP2, packed rows, DCP checkpoints) and export a Hugging Face folder."""
    _quiet_defaults()
    from sftflow.tasks.train.config import TrainConfig
    from sftflow.tasks.train.launch import train as run_train

    raw = _load_yaml(config)
    if data is not None:
        raw["data"] = _index_dir(data)
        raw.setdefault("tokenizer", _data_tokenizer(data))
        if (data / "data.json").is_file():
            from sftflow.flows.data import load_data_result

            raw.setdefault("chat_template", load_data_result(data).chat_template)
    elif "data" not in raw:
        raise ValueError("--data is required: the folder written by `sftflow data` (or a dataset index folder)")
    flags = dict(
        plan=str(plan),
        model=model,
        out=str(out),
        nproc=nproc,
        max_steps=max_steps,
        checkpoint_every=checkpoint_every,
        keep_last=keep_last,
        lr=lr,
        seed=seed,
        init_from=init_from,
        load_components=load_components,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id,
        compile=compile,
        parallel=parallel,
    )
    for key, value in flags.items():
        _set(raw, key, value)
    lora = dict(rank=lora_rank, alpha=lora_alpha, dropout=lora_dropout, targets=lora_targets)
    if any(v is not None for v in lora.values()):
        raw["lora"] = {**(raw.get("lora") or {}), **{k: v for k, v in lora.items() if v is not None}}
    result = run_train(TrainConfig.model_validate(raw), resume=resume)
    typer.echo(result.model_dump_json(indent=2))


def _index_dir(data: Path) -> str:
    if (data / "data.json").is_file():
        from sftflow.flows.data import load_data_result

        return load_data_result(data).index_dir
    if (data / "index.json").is_file():
        return str(data)
    raise ValueError(f"{data}: neither a `sftflow data` output (data.json) nor a dataset index (index.json)")


def _data_tokenizer(data: Path) -> str | None:
    if (data / "data.json").is_file():
        from sftflow.flows.data import load_data_result

        return load_data_result(data).tokenizer.path
    return None


@command("eval")
@_user_errors
def eval_command(
    model: Annotated[str, typer.Option(help="the tuned model: a Hugging Face folder (e.g. RUN/hf)")],
    data: Annotated[Path, typer.Option(help="folder written by `sftflow data`")],
    base: Annotated[str | None, typer.Option(help="base model to compare with (folder, hub id or preset)")] = None,
    seed: Annotated[int, typer.Option(help="seed a preset base was initialised with")] = 0,
    max_docs: Annotated[int | None, typer.Option(help="eval documents for loss/accuracy")] = 512,
    max_generations: Annotated[int, typer.Option(help="documents to generate answers for")] = 64,
    out: Annotated[Path, typer.Option(help="report folder")] = Path("sftflow-out/eval"),
) -> None:
    """Evaluate a model on the eval split: masked loss, perplexity, token accuracy, greedy exact match."""
    _quiet_defaults()
    from sftflow.tasks.eval_report import markdown_summary
    from sftflow.tasks.eval_stage import evaluate_run
    from sftflow.tasks.manifests import EvalConfig, ModelRef

    tokenizer = _data_tokenizer(data) or model
    base_ref = ModelRef(spec=base, seed=seed) if base else None
    config = EvalConfig(max_docs=max_docs, max_generations=max_generations)
    metrics = Path(model).parent / "metrics.jsonl"
    result, _ = evaluate_run(
        ModelRef(spec=model), base_ref, _index_dir(data), tokenizer, config, out, metrics if metrics.is_file() else None
    )
    typer.echo(markdown_summary(result, out / "loss_curve.png" if metrics.is_file() else None))


def _sft_config(config: Path | None, work_dir: str | None):
    """The config file given, or the bundled demo, with `--work-dir` applied."""
    from sftflow.flows.config import SFTConfig
    from sftflow.flows.demo import demo_config

    cfg = SFTConfig.from_yaml(config) if config else demo_config()
    if work_dir:
        cfg = cfg.model_copy(update={"work_dir": str(Path(work_dir).resolve())})
    return cfg


@command()
@_user_errors
def run(
    config: Annotated[Path | None, typer.Argument(help="YAML SFTConfig (default: the bundled demo)")] = None,
    work_dir: Annotated[str | None, typer.Option(help="override the config's work_dir")] = None,
    learning_rate: Annotated[float | None, typer.Option(help="override train.lr")] = None,
    max_steps: Annotated[int | None, typer.Option(help="override train.max_steps")] = None,
    force: Annotated[list[str] | None, typer.Option(help="recompute a stage: data|plan|train|eval")] = None,
    promote: Annotated[
        bool, typer.Option("--promote", help="end with the promotion gate (see `sftflow promote`)")
    ] = False,
) -> None:
    """Run the whole `sft` pipeline in-process (Prefect's local ephemeral API): data → plan → train → eval."""
    _quiet_defaults()
    from sftflow.flows.sft import sft

    cfg = _sft_config(config, work_dir)
    with _flow_session(cfg.work_dir):
        result = sft(config=cfg, learning_rate=learning_rate, max_steps=max_steps, force=force or [], promote=promote)
    typer.echo(_final_report(result))


@command()
@_user_errors
def promote(
    config: Annotated[Path | None, typer.Argument(help="YAML SFTConfig (default: the bundled demo)")] = None,
    work_dir: Annotated[str | None, typer.Option(help="override the config's work_dir")] = None,
) -> None:
    """Promote the work folder's latest trained model if it beats the registry's champion on the same eval docs."""
    _quiet_defaults()
    from sftflow.flows.promote import sft_promote

    cfg = _sft_config(config, work_dir)
    with _flow_session(cfg.work_dir):
        result = sft_promote(config=cfg)
    typer.echo(Path(result.report_path).read_text())


@command()
@_user_errors
def server(
    stop: Annotated[bool, typer.Option("--stop", help="stop the server now instead of when it goes idle")] = False,
) -> None:
    """The local Prefect API server sftflow commands share when PREFECT_API_URL is not set: where it is, or stop it."""
    _quiet_defaults()
    from pathlib import Path as _Path

    from prefect.settings import PREFECT_API_URL, PREFECT_HOME

    from sftflow.flows.local_api import healthy, read_record, state_dir, stop_server

    folder = state_dir(_Path(PREFECT_HOME.value()).expanduser())
    if PREFECT_API_URL.value():
        typer.echo(f"PREFECT_API_URL is set ({PREFECT_API_URL.value()}): commands use that server, not a local one")
    if stop:
        stopped = stop_server(folder)
        typer.echo("stopped the local Prefect API server" if stopped else "no local Prefect API server runs")
        return
    record = read_record(folder)
    if record is None or not healthy(record.url):
        typer.echo("no local Prefect API server runs; the next command that runs a flow starts one")
    else:
        where = record.url.removesuffix("/api")
        typer.echo(f"local Prefect API server: {where} (pid {record.pid}), log {folder / 'server.log'}")


def _final_report(result) -> str:
    lines = ["", "sftflow run finished", ""]
    lines.append(f"  data   {result.data.index.num_train} train / {result.data.index.num_eval} eval documents")
    s = result.plan.stats
    lines.append(f"  plan   {s.num_steps} steps, packing efficiency {s.efficiency:.1%}")
    lines.append(
        f"  train  {result.train.steps} steps, final loss {result.train.final_loss:.4f} → {result.train.hf_dir}"
    )
    lines.append("")
    lines.append(f"  {'model':<6} {'loss':>8} {'ppl':>8} {'tok acc':>8} {'exact':>8} {'overlap':>8}")
    for name, m in result.eval.metrics.items():
        em = "n/a" if m["exact_match"] is None else f"{m['exact_match']:.1%}"
        ov = "n/a" if m["overlap"] is None else f"{m['overlap']:.3f}"
        lines.append(
            f"  {name:<6} {m['loss']:>8.4f} {m['perplexity']:>8.2f} {m['token_accuracy']:>8.1%} {em:>8} {ov:>8}"
        )
    lines.append("")
    lines.append(f"  report {result.eval.markdown_path}")
    if result.promotion is not None:
        lines.append(f"  promote {result.promotion.decision}: champion {result.promotion.champion}")
    if result.eval.plot_path:
        lines.append(f"  plot   {result.eval.plot_path}")
    return "\n".join(lines)
