"""`SFTConfig`: the one typed parameter of the `sft` flow, loadable from YAML.

Sections mirror the stages. `train` is `TrainOptions`, the model `TrainConfig` extends with the wiring the flow fills
in (data, plan, out, tokenizer), so there is one source of truth for training options and their defaults.
"""

from __future__ import annotations

import copy
import difflib
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sftflow.tasks.check.config import CheckConfig
from sftflow.tasks.core.manifests import EvalConfig, PromoteConfig
from sftflow.tasks.data.index_config import IndexConfig
from sftflow.tasks.data.render import RenderConfig
from sftflow.tasks.data.spans import SpansConfig
from sftflow.tasks.eval.bench_config import BenchConfig, BenchTask
from sftflow.tasks.plan.config import PlanConfig, SourceAmount, SourceShare
from sftflow.tasks.plan.row_length import RowLength
from sftflow.tasks.track.config import TrackConfig
from sftflow.tasks.train.config import TrainOptions, check_one_micro_batch


class SourceSpec(SourceAmount):
    """One data source and, for a mixture, how much of it each epoch takes (trained tokens): a `weight` (share of
    the mix), `max_tokens` (a cap) or `epochs` (passes, fractions allowed); see `sftflow.tasks.plan.mixture`."""

    path: str | None = Field(None, description="JSONL / Parquet file or local `datasets` folder")
    hub: str | None = Field(None, description="or a Hugging Face Hub dataset id, read through `datasets`")
    revision: str | None = Field(None, description="the hub dataset's commit (default: resolved once and recorded)")
    subset: str | None = Field(None, description="the hub dataset's configuration (`name` in `load_dataset`)")
    split: str | None = Field(None, description="the hub dataset's split (default: train)")
    name: str | None = Field(None, description="name in stats and per-source metrics (default: file name or hub id)")

    @model_validator(mode="after")
    def _one_location(self):
        if (self.path is None) == (self.hub is None):
            raise ValueError("a source needs one of `path` (a local file or folder) and `hub` (a dataset id)")
        if self.hub is None and (self.revision is not None or self.subset is not None or self.split is not None):
            raise ValueError("`revision`, `subset` and `split` are for `hub` sources")
        return self

    @property
    def share(self) -> SourceShare:
        return SourceShare(name=self.name, **{key: getattr(self, key) for key in SourceAmount.model_fields})


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sources: list[str | SourceSpec] = Field(
        min_length=1,
        description="JSONL / Parquet files or local `datasets` folders, each a path or {path, name, weight, "
        "max_tokens, epochs}",
    )
    tokenizer: str = Field(description="tokenizer folder or hub id")
    render: RenderConfig = Field(RenderConfig(), description="records to text and trained character spans")
    spans: SpansConfig = Field(SpansConfig(), description="text to token ids and token loss spans")
    index: IndexConfig = Field(IndexConfig(), description="filters, deduplication and the train/eval split")
    task_runner: Literal["threads", "processes", "dask"] = Field(
        "threads", description="where the per-shard stages run"
    )
    workers: int | None = Field(
        default=None, ge=1, description="task-runner workers (default: one per core this process may use)"
    )
    dask_address: str | None = Field(default=None, description="scheduler address of an existing Dask cluster")
    shard_bytes: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        default="auto",
        description="split each source into shards of about this many bytes (JSONL: byte ranges ending at a line end; "
        "Parquet: whole row groups; datasets: rows of about this much Arrow data); auto: a source under 16 MiB is "
        "one shard, a larger one ~8 MiB shards (at most 256); null: every source one shard",
    )
    shard_records: int | None = Field(
        default=None, ge=1, description="or split each source into shards of this many lines (JSONL) or rows"
    )

    @model_validator(mode="after")
    def _one_shard_size(self):
        if isinstance(self.shard_bytes, int) and self.shard_records is not None:
            raise ValueError("data: give at most one of shard_bytes and shard_records")
        self.source_specs  # noqa: B018 -- names must be unique; checked once here
        return self

    @property
    def source_specs(self) -> list[SourceSpec]:
        """Every source as a `SourceSpec` with its name: the given one, else the file name, else (two sources of
        the same file name) the path."""
        specs = [SourceSpec(path=s) if isinstance(s, str) else s for s in self.sources]
        file_names = [Path(s.path).name if s.path is not None else s.hub for s in specs]
        named = [
            s.model_copy(update={"name": s.name or (f if file_names.count(f) == 1 else s.path or s.hub)})
            for s, f in zip(specs, file_names, strict=True)
        ]
        names = [s.name for s in named]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"data.sources: two sources are named {repeated}; give each a distinct `name`")
        return named

    @property
    def mixture(self) -> tuple[SourceShare, ...]:
        """The plan's mixture: every source's share, or () when no source asks for one (each document once)."""
        specs = self.source_specs
        return tuple(s.share for s in specs) if any(s.mixes for s in specs) else ()


class DemoConfig(BaseModel):
    """Generate the bundled demo data and tokenizer into `work_dir/demo` and train on them."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    records: int = Field(4000, ge=10, description="generated conversations")
    seed: int = Field(0, description="seed of the generated data")
    bench: bool = Field(False, description="also benchmark base vs tuned on the demo's arithmetic and capitals tasks")


class SFTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    work_dir: str = Field("sftflow-out", description="where every stage writes (relative to the config file)")
    train_retries: int = Field(2, ge=0, description="automatic resumes of a failed training run")
    demo: DemoConfig | None = Field(None, description="generate the demo data and tokenizer instead of `data`")
    data: DataConfig | None = Field(None, description="the sources and how they become training data")
    plan: PlanConfig = Field(PlanConfig(), description="rows, micro-batches and steps")
    train: TrainOptions = Field(TrainOptions(), description="the model and how it trains")
    eval: EvalConfig = Field(EvalConfig(), description="what the evaluation report covers")
    promote: PromoteConfig = Field(PromoteConfig(), description="the promotion gate and where it publishes")
    bench: BenchConfig = Field(BenchConfig(), description="benchmark tasks")
    track: TrackConfig = Field(TrackConfig(), description="experiment trackers")
    check: CheckConfig = Field(CheckConfig(), description="`sftflow check`: samples and bounds")

    @classmethod
    def from_yaml(cls, path: str | Path) -> SFTConfig:
        return load_config(path)

    def accumulates(self) -> bool:
        """Whether a training process adds up several micro-batches a step (fp32 gradients on one GPU): several
        asked for, as many as a token target needs, or a plan for more ranks than processes (each takes several
        planned ranks' rows)."""
        world = self.train.nproc * self.train.nnodes
        return (
            (self.plan.micro_batches_per_step or 1) > 1
            or self.plan.target_tokens_per_step is not None
            or (self.plan.num_ranks or world) > world
        )

    @model_validator(mode="after")
    def _one_micro_batch_when_stepping_in_backward(self) -> SFTConfig:
        facts = (
            "the plan adds up several a step (plan.micro_batches_per_step, target_tokens_per_step, or num_ranks above "
            "the training processes)"
        )
        check_one_micro_batch(self.train.optimizer, self.accumulates(), facts)
        return self

    @model_validator(mode="after")
    def _plan_leaves_the_flow_its_fields(self) -> SFTConfig:
        if self.plan.mixture:
            raise ValueError("plan.mixture: set each source's weight, max_tokens or epochs in data.sources instead")
        if self.plan.max_steps is not None:
            raise ValueError("plan.max_steps: set train.max_steps instead")
        return self

    @model_validator(mode="after")
    def _bench_rules_need_bench(self) -> SFTConfig:
        if not self.promote.bench_rules:
            return self
        if not (self.bench.enabled or (self.demo is not None and self.demo.bench)):
            raise ValueError("promote.bench_*: rules on benchmark scores need tasks; name them in bench.tasks")
        if not self.bench.compare_base:
            raise ValueError("promote.bench_*: the rules compare with the base model; set bench.compare_base: true")
        return self


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML run config as a mapping, its relative paths made relative to the file (not the working directory), so
    a config and its data can travel together. Paths that may also name something else (a tokenizer or model hub
    id, a built-in template, a preset) are taken from the file's folder only where something exists there."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: config file not found")
    raw = yaml.safe_load(p.read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: config must be a mapping at the top level")
    work_dir = Path(raw.get("work_dir", SFTConfig.model_fields["work_dir"].default))
    raw["work_dir"] = str(work_dir if work_dir.is_absolute() else (p.parent / work_dir).resolve())
    data = raw.get("data") or {}
    if isinstance(data, dict) and isinstance(data.get("sources"), list):
        data["sources"] = [_source_relative_to(p, s) for s in data["sources"]]
    promote = raw.get("promote") or {}
    if isinstance(promote, dict) and isinstance(promote.get("registry"), str):
        promote["registry"] = str(_relative_to(p, promote["registry"]).resolve())
    plan = raw.get("plan") or {}
    if isinstance(plan, dict) and isinstance(plan.get("cost_table"), str):
        plan["cost_table"] = str(_relative_to(p, plan["cost_table"]).resolve())
    index = data.get("index") if isinstance(data, dict) else None
    decontam = index.get("decontaminate") if isinstance(index, dict) else None
    if isinstance(decontam, dict) and isinstance(decontam.get("benchmarks"), list):
        decontam["benchmarks"] = [str(_relative_to(p, b)) if isinstance(b, str) else b for b in decontam["benchmarks"]]
    bench = raw.get("bench") or {}
    if isinstance(bench, dict) and isinstance(bench.get("tasks"), list):
        bench["tasks"] = [_source_relative_to(p, t) for t in bench["tasks"]]
    render = data.get("render") if isinstance(data, dict) else None
    train = raw.get("train")
    for section, key in (
        (data, "tokenizer"),
        (render, "template"),
        (train, "model"),
        (train.get("checkpoint") if isinstance(train, dict) else None, "init_from"),
    ):
        if isinstance(section, dict) and isinstance(section.get(key), str):
            if _relative_to(p, section[key]).exists():
                section[key] = str(_relative_to(p, section[key]))
    return raw


def _source_relative_to(config_path: Path, source):
    if isinstance(source, str):
        return str(_relative_to(config_path, source))
    if isinstance(source, dict) and isinstance(source.get("path"), str):
        return {**source, "path": str(_relative_to(config_path, source["path"]))}
    return source  # validation names what is wrong


def parse_assignments(assignments: list[str]) -> dict[str, Any]:
    """`["train.optimizer.lr=1e-4", "data.sources=[a.jsonl]"]` as `{"train.optimizer.lr": "1e-4", ...}`.

    A value is read as YAML where that gives a list, a mapping or `null`; a number or a word stays the text it was
    (unquoted), which pydantic then converts to the field's type: `rdzv_id=42` stays the string a `str` field needs,
    and `lr=1e-4` (a string to YAML 1.1) becomes a float."""
    overrides = {}
    for item in assignments:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.optimizer.lr=1e-4")
        value = yaml.safe_load(text) if text.strip() else None
        if isinstance(value, (bool, int, float)):
            value = text.strip()
        overrides[key.strip()] = value
    return overrides


def load_config(
    path: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    default: dict | None = None,
    given_by: str = "command line (--set or an option)",
) -> SFTConfig:
    """The run config a command or flow works on: the YAML file at `path` (or `default`, or every field's default),
    with `overrides` (`{"train.optimizer.lr": 1e-4}`) applied before it is validated, so an override is checked, and
    a misspelt key named, exactly as the file's own keys are. The one place a config is overridden: the CLI's `--set`
    and options and the flows' `overrides` (`resolve_config`) all come here. `given_by`: what an error blames for a
    bad override."""
    raw = read_config_file(path) if path is not None else copy.deepcopy(default or {})
    for key, value in (overrides or {}).items():
        *parents, name = key.split(".")
        section = raw
        for i, parent in enumerate(parents):
            child = section.get(parent)
            if child is None:
                child = section[parent] = {}
            if not isinstance(child, dict):
                raise ValueError(f"{key}: '{'.'.join(parents[: i + 1])}' is a value, not a section")
            section = child
        section[name] = value
    try:
        return SFTConfig.model_validate(raw)
    except ValidationError as err:
        raise ValueError(_blame(err, path, set(overrides or {}), given_by)) from None


def _blame(err: ValidationError, path, override_keys: set[str], given_by: str) -> str:
    """The problems of a config, each under what set the key: the overrides (`given_by`: the command line's `--set`
    and options, or a flow's `overrides`) or the file, so a typo in `--set` is not reported as the file's."""

    def overridden(error) -> bool:
        where = ".".join(str(part) for part in error["loc"])
        return any(where == key or where.startswith(f"{key}.") for key in override_keys)

    errors = err.errors()
    given = [e for e in errors if overridden(e)]
    written = [e for e in errors if not overridden(e)]
    parts = []
    if given:
        parts.append(f"{given_by}: {explain_errors(given, SFTConfig)}")
    if written:
        parts.append(f"{path or 'config'}: {explain_errors(written, SFTConfig)}")
    return "; ".join(parts)


def config_field(key: str):
    """The pydantic field behind a dotted config key (`plan.tokens_per_rank`), for help texts."""
    *parents, name = key.split(".")
    model = _model_at(SFTConfig, parents)
    if model is None or name not in model.model_fields:
        raise KeyError(f"{key}: not a config field")
    return model.model_fields[name]


def keys_named(name: str, model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """Every dotted config key whose last part is `name` (`keep_last` -> `["train.checkpoint.keep_last"]`)."""
    found = []
    for field_name in (model or SFTConfig).model_fields:
        key = f"{prefix}{field_name}"
        if field_name == name:
            found.append(key)
        nested = _model_at(model or SFTConfig, [field_name])
        if nested is not None:
            found += keys_named(name, nested, f"{key}.")
    return found


def _model_at(model: type[BaseModel], path: list[str]) -> type[BaseModel] | None:
    """The (nested) model at `path` of `model`, or None where `path` leaves the models."""
    for name in path:
        field = model.model_fields.get(name)
        if field is None:
            return None
        if typing.get_origin(field.annotation) is list:
            return None  # the items of a list (bench.tasks) have no dotted key of their own
        candidates = [field.annotation, *typing.get_args(field.annotation)]
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not nested:
            return None
        model = nested[0]
    return model


def _field_names(model: type[BaseModel], path: list[str]) -> list[str]:
    """The field names of the (nested) model at `path` of `model`, or [] where `path` leaves the models."""
    found = _model_at(model, path)
    return sorted(found.model_fields) if found is not None else []


def explain_validation_error(err: ValidationError, model: type[BaseModel]) -> str:
    """Every problem of a config in one line; an unknown key comes with the closest valid names (a typo), or the
    valid ones."""
    return explain_errors(err.errors(), model)


# A part of an error's location that names a union's member (`constrained-int`, `literal['auto']`, `int`), not a key.
_KEY_PART = re.compile(r"[A-Za-z_]\w*|\d+")
_TYPE_NAMES = {"int", "float", "str", "bool", "none", "list", "dict", "tuple", "bytes"}


def _key_path(loc: tuple) -> list[str]:
    """An error's location as the user's keys: the members of a union (`int | "auto"`) left out."""
    parts = [str(part) for part in loc]
    return [p for p in parts if _KEY_PART.fullmatch(p) and p not in _TYPE_NAMES]


def explain_errors(errors: list, model: type[BaseModel]) -> str:
    """`explain_validation_error` for some of a `ValidationError`'s errors: one problem per key, the messages of a
    union's members joined with "or"."""
    # In first-seen order: a whole problem for a key that is unknown or moved, and for a value, the messages of all
    # that it failed at one key (each member of a union): one problem naming what each member takes.
    problems: dict[tuple[str, str], list[str]] = {}
    for error in errors:
        loc = _key_path(error["loc"])
        where = ".".join(loc)
        moved = _moved_key(model, loc)
        if error["type"] == "extra_forbidden" and moved is not None:
            problems[("text", f"'{where}' is now '{moved}'")] = []
        elif error["type"] == "extra_forbidden":
            valid = _field_names(model, loc[:-1])
            close = difflib.get_close_matches(loc[-1], valid, n=3, cutoff=0.6)
            if close:
                hint = f"; did you mean {' or '.join(repr('.'.join([*loc[:-1], c])) for c in close)}?"
            else:
                hint = f"; expected one of {', '.join(valid)}" if valid else ""
            problems[("text", f"unknown key '{where}'{hint}")] = []
        else:
            problems.setdefault(("value", where), []).append(error["msg"])
    lines = []
    for (kind, text), messages in problems.items():
        msg = " or ".join(dict.fromkeys(messages))
        lines.append(text if kind == "text" else f"'{text}': {msg}" if text else msg)
    return "; ".join(lines)


def _moved_key(model: type[BaseModel], loc: list[str]) -> str | None:
    """The key that replaced the removed key at `loc` (its section's `moved_keys`), or None."""
    section = _model_at(model, loc[:-1])
    return getattr(section, "moved_keys", {}).get(loc[-1]) if section is not None and loc else None


def _relative_to(config_path: Path, value: str) -> Path:
    v = Path(value)
    return v if v.is_absolute() else (config_path.parent / v).resolve()


# The flows' flat parameters (`prefect deployment run sft/full -p learning_rate=1e-5`), each a shorthand of one
# config key: merged into the flow's `overrides`, never applied on their own.
SHORTHANDS = {"learning_rate": "train.optimizer.lr", "max_steps": "train.max_steps", "epochs": "plan.epochs"}


def with_shorthands(overrides: dict[str, Any] | None, **shorthands: Any) -> dict[str, Any]:
    """`overrides` (dotted keys) with the shorthand parameters given (`learning_rate=1e-5`, see `SHORTHANDS`) added
    under their keys; a shorthand and an override of the same key is refused rather than one silently winning."""
    merged = dict(overrides or {})
    for name, value in shorthands.items():
        if value is None:
            continue
        key = SHORTHANDS[name]
        if key in merged:
            raise ValueError(f"{name} and overrides[{key!r}] both set {key}; give one of them")
        merged[key] = value
    return merged


def resolve_config(
    config_path: str | None, config: SFTConfig | None, overrides: dict[str, Any] | None = None
) -> SFTConfig:
    """A flow's config: a YAML path or an inline object, with `overrides` (`{"train.optimizer.lr": 1e-5}`, the
    flow's shorthands merged in by `with_shorthands`) applied as the CLI's `--set` is (`load_config`)."""
    if (config_path is None) == (config is None):
        raise ValueError("give exactly one of config_path (a YAML file) or config (inline)")
    if not overrides:
        return SFTConfig.from_yaml(config_path) if config_path else config
    default = None if config_path else config.model_dump()
    return load_config(config_path, overrides, default=default, given_by="overrides")


def data_config(cfg: SFTConfig) -> DataConfig:
    """The data section; with `demo`, the generated conversations and tokenizer (written once, reused after)."""
    if cfg.demo is None:
        if cfg.data is None:
            raise ValueError("config: set `data` (sources and tokenizer) or `demo`")
        return cfg.data
    from sftflow.tasks.demo import write_demo

    paths = write_demo(Path(cfg.work_dir) / "demo", n=cfg.demo.records, seed=cfg.demo.seed)
    base = cfg.data.model_dump() if cfg.data else {"render": {"template": "chatml"}, "index": {"eval_fraction": 0.1}}
    base.update(sources=[str(paths["data"])], tokenizer=str(paths["tokenizer"]))
    return DataConfig.model_validate(base)


def registry_root(cfg: SFTConfig) -> Path:
    """The model registry the gate promotes into (and whose champion sft-bench scores)."""
    return Path(cfg.promote.registry) if cfg.promote.registry else Path(cfg.work_dir).resolve() / "registry"


def bench_config(cfg: SFTConfig) -> BenchConfig:
    """The bench section; with `demo.bench`, the demo's own tasks too (written once beside its data)."""
    if cfg.demo is None or not cfg.demo.bench:
        return cfg.bench
    from sftflow.tasks.demo import DEMO_BENCH, write_demo_bench

    paths = write_demo_bench(Path(cfg.work_dir) / "demo" / "bench")
    tasks = [BenchTask(path=str(paths[name]), **settings) for name, settings in DEMO_BENCH.items()]
    # Validated again: a task of the user's may share a demo task's name.
    return BenchConfig.model_validate({**cfg.bench.model_dump(), "tasks": [*tasks, *cfg.bench.tasks]})


def plan_config(cfg: SFTConfig, vocab_size: int | None = None) -> PlanConfig:
    """The `plan` section with what it leaves to the flow filled in (`plan_inputs`)."""
    return plan_inputs(cfg, vocab_size)[0]


def plan_inputs(cfg: SFTConfig, vocab_size: int | None = None) -> tuple[PlanConfig, RowLength]:
    """The `plan` section with what it leaves to the flow filled in: `num_ranks`, the mixture of `data.sources`, and
    `tokens_per_rank` as the resolved run's rules choose it (`sftflow.tasks.train.resolved.resolve_rows`; `auto`: the
    longest row the training GPUs fit), so the plan's cache key holds the number it planned with; and that choice,
    for the plan to record. `vocab_size`: the data's, for a preset model (whose vocabulary comes from the data)."""
    from sftflow.tasks.train.resolved import plan_hardware, resolve_rows

    num_ranks = cfg.plan.num_ranks or cfg.train.nproc * cfg.train.nnodes
    setting = cfg.plan.tokens_per_rank
    hardware = plan_hardware(cfg.plan.device_memory_gib) if setting == "auto" else None
    rows = resolve_rows(
        cfg.train, hardware, setting=setting, num_ranks=num_ranks, vocab_size=vocab_size,
        accumulating=cfg.accumulates(),
    )  # fmt: skip
    mixture = cfg.data.mixture if cfg.data is not None and cfg.demo is None else ()
    resolved = {"num_ranks": num_ranks, "tokens_per_rank": rows.value, "device_memory_gib": None}
    config = PlanConfig.model_validate({**cfg.plan.model_dump(), **resolved, "mixture": mixture})
    return config, RowLength(value=rows.value, setting=rows.setting, reason=rows.reason)


def validated_models() -> dict[str, type[BaseModel]]:
    """The config models the CLI validates, by name (a `ValidationError` names its model), for error messages."""
    from sftflow.tasks.train.config import TrainConfig

    return {m.__name__: m for m in (SFTConfig, DataConfig, PlanConfig, TrainConfig, TrainOptions)}
