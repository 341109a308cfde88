"""`sftflow` command line: each command runs one flow (or the whole `sft` flow) in-process.

User errors (bad input, bad config) end with a one-line message naming the file, record and field, and exit code 2;
no traceback.
"""

from __future__ import annotations

import json
import os
import re
import typing
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from pydantic_core import PydanticUndefined
from typer.core import TyperCommand, TyperGroup

# One word for what an option takes, in place of a type tag: a flag takes nothing, choices are listed instead.
_METAVARS = {"path": "PATH", "int": "N", "float": "X", "str": "TEXT"}
_CHOICES = re.compile(r"^(\w+(?:\|\w+)+)(?::\s*(.*))?$")


# click's names for the same types, as typer releases before its own type descriptors report them
_CLICK_TYPES = {"integer": "int", "text": "str", "file": "path", "directory": "path"}


def _type_name(param) -> str:
    """The option's value type as a bare name (int, float, str, path): typer's own `display_type` where it has one,
    else click's type name (older typer releases, as GPU images ship them, have only that)."""
    if hasattr(param, "display_type"):
        return param.display_type(None).strip("<>").removeprefix("list[").removesuffix("]")
    name = param.type.name
    return _CLICK_TYPES.get(name, name)


class _Command(TyperCommand):
    """Help that reads as usage: `--task-runner threads|processes|dask`, `--max-length N`, `--force` alone, and options
    a command cannot run without (unless a config file gives them) marked. An option that sets a config field
    (`_option`) shows that field's choices and default, read from the config models only when help is shown, so a
    command that runs does not import them twice."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        keys = _config_keys(self.callback) if self.callback else {}
        for param in self.params:
            if param.param_type_name != "option":
                continue
            param.config_key = keys.get(param.name)
            if param.is_flag:
                param.metavar = ""
                continue
            choices = _CHOICES.match(param.help or "")
            if choices:
                param.metavar, param.help = choices.group(1), choices.group(2) or ""
            elif param.metavar is None:
                kind = _type_name(param)
                param.metavar = _METAVARS.get(kind, kind.upper())
            if param.multiple:
                param.help = f"{param.help} (repeat for more)".strip()

    def format_help(self, ctx, formatter):
        from sftflow.flows.config import config_field

        for param in self.params:
            key = getattr(param, "config_key", None)
            if key is None:
                continue
            field = config_field(key)
            choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is Literal else ()
            if choices and not param.is_flag:
                param.metavar = "|".join(choices)
            default = field.default
            if isinstance(default, (tuple, list)):
                default = ",".join(map(str, default))
            shown = "" if default in (None, PydanticUndefined) or param.is_flag else f", default {default}"
            param.help = f"{param.help or field.description or ''} ({key}{shown})".strip()
        return super().format_help(ctx, formatter)

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except Exception as err:
            # An unknown option (click's NoSuchOption, which typer vendors): most config fields have no option of
            # their own, so point at the --set that sets one.
            name = getattr(err, "option_name", None)
            if isinstance(name, str) and isinstance(getattr(err, "message", None), str):
                from sftflow.flows.config import keys_named

                keys = keys_named(name.lstrip("-").replace("-", "_"))
                if keys:
                    err.message += "; set it with " + " or ".join(f"--set {k}=VALUE" for k in keys)
            raise

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option


class _Group(TyperGroup):
    """`sftflow --help`: its options (`--debug`, `--help`) are flags, shown alone as in each command's help."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for param in self.params:
            if param.param_type_name == "option" and param.is_flag:
                param.metavar = ""

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option


app = typer.Typer(
    cls=_Group, add_completion=False, no_args_is_help=True, help="Supervised fine-tuning as a Prefect pipeline."
)


def _option(key: str, *names: str, help: str | None = None) -> Any:
    """A command-line option that sets the config field `key` (`train.optimizer.lr`); it has no default of its own
    (the field's is the only one, shown in the help), and an option not given leaves the config as it is."""
    option = typer.Option(*names, help=help)
    option.config_key = key
    return option


def _config_keys(fn) -> dict[str, str]:
    """`{parameter name: config key}` of the `_option` parameters of a command function."""
    hints = typing.get_type_hints(fn, include_extras=True)
    return {
        name: meta.config_key
        for name, hint in hints.items()
        for meta in getattr(hint, "__metadata__", ())
        if getattr(meta, "config_key", None)
    }


def _run_config(command, values: dict[str, Any], default: dict | None = None):
    """The config a command works on: `--config` (or `default`, or the models' defaults), then `--set`
    assignments, then the command's own options (`_option`) that were given; all validated as one `SFTConfig`."""
    from sftflow.flows.config import load_config, parse_assignments

    overrides = parse_assignments(values.get("set") or [])
    for name, key in _config_keys(command).items():
        if values[name] is not None and values[name] is not False:  # a flag left off sets nothing
            overrides[key] = values[name]
    return load_config(values.get("config"), overrides, default=default)


ConfigFile = Annotated[
    Path | None,
    typer.Option(
        "--config", help="YAML run config, as `sftflow run` takes (its relative paths are relative to the file)"
    ),
]
Assignments = Annotated[
    list[str] | None,
    typer.Option(
        "--set", metavar="KEY=VALUE", help="set any config field: --set train.optimizer.lr=1e-4, --set plan.epochs=3"
    ),
]


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

    from sftflow.flows.console import USER_ERRORS
    from sftflow.flows.local_api import LocalAPIError
    from sftflow.tasks.core.disk_full import as_disk_full
    from sftflow.tasks.train.errors import TrainingFailed

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValidationError as err:
            from sftflow.flows.config import explain_validation_error, validated_models

            _fail(f"config: {explain_validation_error(err, validated_models().get(err.title, BaseModel))}")
        except (*USER_ERRORS, LocalAPIError) as err:
            _fail(str(err).splitlines()[0] if str(err) else type(err).__name__)
        except TrainingFailed as err:  # a crash, not bad input: one line too, with the log above it
            _fail(str(err), code=1)
        except OSError as err:
            full = as_disk_full(err, "?")
            if full is None:
                raise
            # what the rerun does, where the error does not say (training says which checkpoint it resumes from)
            _fail(str(full.adding(rerun="the work already done is reused")))

    return wrapper


def _notice(message: str) -> None:
    typer.secho(message, err=True, fg=typer.colors.BLUE)


@contextmanager
def _flow_session(work_dir: str | Path):
    """What a command that runs flows holds while they run: the work folder's lock (taken first, so a busy folder is
    refused at once, without a Prefect API), the Prefect API (`sftflow.flows.local_api`) and a watch that ends the
    command if that API goes away (`sftflow.flows.api_watch`), and a log of the runs in the work folder that keeps
    tracebacks off the terminal (`sftflow.flows.console`)."""
    from sftflow.flows.api_watch import api_watched
    from sftflow.flows.console import logged_to
    from sftflow.flows.local_api import prefect_api
    from sftflow.flows.results import work_dir_lock

    work = Path(work_dir).resolve()
    # Where the files go, links and `..` resolved: a relative or linked work_dir may lie outside the project.
    _notice(f"work dir: {work}")
    with work_dir_lock(work), prefect_api(notice=_notice) as api, api_watched(api), logged_to(work):
        yield


@command()
@_user_errors
def data(
    source: Annotated[
        list[str] | None,
        _option("data.sources", "--source", help="JSONL/Parquet file or datasets folder (required without --config)"),
    ] = None,
    tokenizer: Annotated[
        str | None, _option("data.tokenizer", help="tokenizer folder or hub id (required without --config)")
    ] = None,
    template: Annotated[
        str | None, _option("data.render.template", help="built-in name (chatml, llama3, ...), .jinja file or auto")
    ] = None,
    format: Annotated[str | None, _option("data.render.format", help="record format of the sources")] = None,
    mask_policy: Annotated[
        str | None, _option("data.render.mask_policy", help="what trains: generation tags or roles")
    ] = None,
    bos: Annotated[str | None, _option("data.spans.bos", help="add BOS when the template did not")] = None,
    eos: Annotated[str | None, _option("data.spans.eos", help="add a trained EOS")] = None,
    max_length: Annotated[int | None, _option("data.spans.max_length", help="longest document in tokens")] = None,
    on_bad_record: Annotated[
        str | None, _option("data.render.on_bad_record", help="stop on a bad record, or count it in a rejects file")
    ] = None,
    tokenizer_backend: Annotated[
        str | None, _option("data.spans.tokenizer_backend", help="who tokenizes (auto: tiktoken when exact)")
    ] = None,
    task_runner: Annotated[str | None, _option("data.task_runner", help="where the per-shard stages run")] = None,
    workers: Annotated[int | None, _option("data.workers")] = None,
    shard_bytes: Annotated[
        str | None, _option("data.shard_bytes", help="split sources into shards of ~N bytes, or auto (the default)")
    ] = None,
    force: Annotated[bool, typer.Option(help="recompute every stage, ignoring the cache")] = False,
    config: ConfigFile = None,
    set: Assignments = None,
    out: Annotated[Path | None, typer.Option(help="output folder (default: WORK_DIR/data)")] = None,
) -> None:
    """Render, tokenize and pack conversations into pbin shards plus a dataset index (the `sft-data` flow)."""
    _quiet_defaults()
    from sftflow.flows.data import sft_data

    cfg = _run_config(data, locals())
    if cfg.data is None and cfg.demo is None:
        raise ValueError("--source and --tokenizer are required (or `data: {sources, tokenizer}` in --config)")
    out = out or Path(cfg.work_dir) / "data"
    with _flow_session(out):
        result = sft_data(config=cfg.model_copy(update={"work_dir": str(out.resolve())}), force=force)
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
    data: Annotated[
        Path | None,
        typer.Option(help="folder written by `sftflow data`, or a dataset index folder (default: WORK_DIR/data)"),
    ] = None,
    lengths: Annotated[
        Path | None, typer.Option(help=".npy of document lengths, instead of --data (capacity planning)")
    ] = None,
    num_ranks: Annotated[int | None, _option("plan.num_ranks")] = None,
    tokens_per_rank: Annotated[
        str | None,
        _option("plan.tokens_per_rank", help="N|auto: tokens in one packed row, or the longest the GPUs' memory fits"),
    ] = None,
    force: Annotated[bool, typer.Option(help="recompute the plan, ignoring the cache")] = False,
    config: ConfigFile = None,
    set: Assignments = None,
    out: Annotated[Path | None, typer.Option(help="output folder for plan.npz (default: WORK_DIR/plan)")] = None,
    stats: Annotated[bool, typer.Option("--stats", help="print the plan statistics")] = False,
    stats_json: Annotated[bool, typer.Option("--stats-json", help="print one JSON object of statistics")] = False,
) -> None:
    """Plan every step × micro-batch × rank up front (the `sft-plan` flow, or plain planning with --lengths)."""
    _quiet_defaults()
    from sftflow.flows.steps import plan_folder

    cfg = _run_config(plan, locals())
    planned = plan_folder(cfg, data=data, lengths=lengths, out=out, force=force, session=_flow_session)
    if stats_json:
        typer.echo(json.dumps(planned.summary()))
    elif stats:
        typer.echo(planned.stats.model_dump_json(indent=2))
    else:
        typer.echo(
            f"plan: {planned.stats.num_steps} steps of {planned.tokens_per_rank:,}-token rows "
            f"({planned.tokens_reason}), efficiency {planned.stats.efficiency:.2%} → {planned.out}"
        )


@command()
@_user_errors
def train(
    data: Annotated[
        Path | None,
        typer.Option(help="folder written by `sftflow data`, or a dataset index folder (default: WORK_DIR/data)"),
    ] = None,
    plan: Annotated[
        Path | None, typer.Option(help="folder holding plan.npz, `sftflow plan --out` (default: WORK_DIR/plan)")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="run directory (default: WORK_DIR/run)")] = None,
    model: Annotated[str | None, _option("train.model", help="local folder, hub id, config.json or preset")] = None,
    nproc: Annotated[int | None, _option("train.nproc", help="worker processes (GPUs) per node")] = None,
    max_steps: Annotated[int | None, _option("train.max_steps", help="stop after N optimizer steps")] = None,
    lr: Annotated[float | None, _option("train.optimizer.lr", help="peak learning rate")] = None,
    checkpoint_every: Annotated[
        int | None, _option("train.checkpoint.every", help="save a checkpoint every N steps")
    ] = None,
    resume: Annotated[
        bool, _option("train.checkpoint.resume", "--resume", help="continue from the run's latest checkpoint")
    ] = False,
    init_from: Annotated[
        str | None, _option("train.checkpoint.init_from", help="checkpoint (step-N folder or run dir) to start from")
    ] = None,
    load_components: Annotated[
        str | None, _option("train.checkpoint.load_components", help="model[,optimizer,lr_scheduler,progress]")
    ] = None,
    nnodes: Annotated[int | None, _option("train.nnodes", help="nodes (multi-node: same command on each)")] = None,
    node_rank: Annotated[int | None, _option("train.node_rank", help="this node's rank")] = None,
    rdzv_endpoint: Annotated[str | None, _option("train.rdzv_endpoint")] = None,
    rdzv_id: Annotated[str | None, _option("train.rdzv_id")] = None,
    compile: Annotated[str | None, _option("train.memory.compile", help="torch.compile each decoder layer")] = None,
    parallel: Annotated[str | None, _option("train.parallel")] = None,
    lora_rank: Annotated[int | None, _option("train.lora.rank", help="train LoRA adapters of this rank")] = None,
    lora_alpha: Annotated[
        float | None, _option("train.lora.alpha", help="LoRA alpha (default: twice the rank)")
    ] = None,
    lora_dropout: Annotated[float | None, _option("train.lora.dropout", help="LoRA dropout")] = None,
    lora_targets: Annotated[
        str | None, _option("train.lora.targets", help="all-linear, or module names: q_proj,v_proj")
    ] = None,
    config: ConfigFile = None,
    set: Assignments = None,
) -> None:
    """Train with torchrun (FSDP2, packed rows, DCP checkpoints) into one run folder and export a Hugging Face
    folder (no Prefect: `sftflow run` is the cached, retried pipeline). With `track:` in the config, the step
    metrics go to the trackers while it trains."""
    _quiet_defaults()
    from sftflow.flows.steps import train_folder, train_folder_config
    from sftflow.tasks.core.disk_full import DiskFull

    cfg = _run_config(train, locals())
    config = train_folder_config(cfg, data=data, plan=plan, out=out)
    _notice(f"run dir: {config.run_dir.resolve()}")
    try:
        result = train_folder(cfg, config)
    except DiskFull as err:
        if not err.rerun or "resumes from" not in err.rerun:
            raise
        # `sftflow run` resumes by itself; this command resumes only when asked.
        raise DiskFull(err.path, err.doing, f"{err.rerun} with --resume") from err
    typer.echo(result.model_dump_json(indent=2))


@command("eval")
@_user_errors
def eval_command(
    model: Annotated[
        str | None, typer.Option(help="the tuned model: a Hugging Face folder (default: WORK_DIR/run/hf)")
    ] = None,
    data: Annotated[Path | None, typer.Option(help="folder written by `sftflow data` (default: WORK_DIR/data)")] = None,
    base: Annotated[str | None, typer.Option(help="base model to compare with (folder, hub id or preset)")] = None,
    out: Annotated[Path | None, typer.Option(help="report folder (default: WORK_DIR/eval)")] = None,
    config: ConfigFile = None,
    set: Assignments = None,
) -> None:
    """Evaluate a model on the eval split: masked loss, perplexity, token accuracy, greedy exact match. The `eval`
    section sets what is covered (e.g. --set eval.max_docs=64); a preset base is built with train.seed."""
    _quiet_defaults()
    from sftflow.flows.steps import eval_folder

    cfg = _run_config(eval_command, locals())
    typer.echo(eval_folder(cfg, model=model, data=data, base=base, out=out))


def _demo_default() -> dict:
    """The bundled demo config, what `run` and `promote` work on without a config file."""
    import yaml

    from sftflow.flows.demo import demo_config_text

    return yaml.safe_load(demo_config_text())


@command()
@_user_errors
def run(
    config: Annotated[Path | None, typer.Argument(help="YAML SFTConfig (default: the bundled demo)")] = None,
    work_dir: Annotated[str | None, typer.Option(help="override the config's work_dir")] = None,
    learning_rate: Annotated[float | None, _option("train.optimizer.lr", "--learning-rate")] = None,
    max_steps: Annotated[int | None, _option("train.max_steps")] = None,
    set: Assignments = None,
    force: Annotated[list[str] | None, typer.Option(help="recompute a stage: data|plan|train|eval|bench")] = None,
    promote: Annotated[
        bool, typer.Option("--promote", help="end with the promotion gate (see `sftflow promote`)")
    ] = False,
) -> None:
    """Run the whole `sft` pipeline in-process: data → plan → train → eval. Its Prefect API is PREFECT_API_URL's
    server when set, else a local server sftflow starts on first use and later commands reuse."""
    _quiet_defaults()
    from sftflow.flows.sft import sft

    cfg = _with_work_dir(_run_config(run, locals(), default=_demo_default()), work_dir)
    with _flow_session(cfg.work_dir):
        result = sft(config=cfg, force=force or [], promote=promote)
    typer.echo(_final_report(result))


def _with_work_dir(cfg, work_dir: str | None):
    return cfg.model_copy(update={"work_dir": str(Path(work_dir).resolve())}) if work_dir else cfg


@command()
@_user_errors
def promote(
    config: Annotated[Path | None, typer.Argument(help="YAML SFTConfig (default: the bundled demo)")] = None,
    work_dir: Annotated[str | None, typer.Option(help="override the config's work_dir")] = None,
    set: Assignments = None,
) -> None:
    """Promote the work folder's latest trained model if it beats the registry's champion on the same eval docs."""
    _quiet_defaults()
    from sftflow.flows.promote import sft_promote

    cfg = _with_work_dir(_run_config(promote, locals(), default=_demo_default()), work_dir)
    with _flow_session(cfg.work_dir):
        result = sft_promote(config=cfg)
    typer.echo(Path(result.report_path).read_text())


@command()
@_user_errors
def check(
    config: Annotated[Path | None, typer.Argument(help="YAML SFTConfig (default: the bundled demo)")] = None,
    docs: Annotated[int | None, _option("check.docs", help="documents to sample from the sources")] = None,
    device: Annotated[str | None, _option("check.device", help="where the loss check runs")] = None,
    work_dir: Annotated[str | None, typer.Option(help="override the config's work_dir")] = None,
    set: Assignments = None,
) -> None:
    """Check your data and model before training: ids and masks equal Hugging Face's apply_chat_template, each trained
    turn teaches one stop, the first step's loss and gradients equal Hugging Face's eager forward per document, 2 ranks
    train as 1, and a run killed (SIGKILL) and resumed as an unbroken one (the last two: a few torchrun steps on the
    CPU; --set check.steps=0 skips them). Prints a table; exits 0 when all pass, 1 when a check fails, 2 on bad
    input."""
    _quiet_defaults()
    from sftflow.flows.check import run_checks

    cfg = _with_work_dir(_run_config(check, locals(), default=_demo_default()), work_dir)
    report = run_checks(cfg)
    typer.echo(report.table())
    raise typer.Exit(code=report.exit_code)


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
        em = "n/a" if m.exact_match is None else f"{m.exact_match:.1%}"
        ov = "n/a" if m.overlap is None else f"{m.overlap:.3f}"
        lines.append(f"  {name:<6} {m.loss:>8.4f} {m.perplexity:>8.2f} {m.token_accuracy:>8.1%} {em:>8} {ov:>8}")
    if result.bench is not None:
        lines.append("")
        models = list(next(iter(result.bench.tasks.values())).scores)
        lines.append(f"  {'bench':<12} {'metric':<12}" + "".join(f" {m:>8}" for m in models))
        for name, task in result.bench.tasks.items():
            lines.append(f"  {name:<12} {task.metric:<12}" + "".join(f" {task.scores[m]:>8.1%}" for m in models))
    lines.append("")
    lines.append(f"  report {result.eval.markdown_path}")
    if result.bench is not None:
        lines.append(f"  bench  {result.bench.markdown_path}")
    if result.promotion is not None:
        lines.append(f"  promote {result.promotion.decision}: champion {result.promotion.champion}")
    if result.eval.plot_path:
        lines.append(f"  plot   {result.eval.plot_path}")
    return "\n".join(lines)
