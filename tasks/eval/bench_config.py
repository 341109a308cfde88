"""Benchmark tasks: what `bench` in the run config names, and each task file resolved with its content hash.

A task file is JSONL, one item a line:
  - `generate` (GSM8K-style): `{"question": "...", "answer": "..."}`. The model answers greedily; the answer it gave
    is the last match of `answer_pattern` in its output (group 1 where the pattern has a group, else the match;
    without a pattern, the whole stripped output), the reference's is the last match of `reference_pattern` in
    `answer` (without one, the whole stripped answer). Score: exact match of the two.
  - `choice` (MMLU/ARC-style): `{"question": "...", "choices": ["...", ...], "answer": 0}` (`answer`: the index of
    the right choice, or its text). The model's pick is the choice of highest log-likelihood after the prompt.
    Score: accuracy.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sftflow.tasks.core.manifests import Manifest


class BenchTask(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(description="the task's name in reports and gate rules")
    path: str = Field(description="JSONL task file (relative paths: relative to the config file)")
    kind: Literal["generate", "choice"] = Field(description="generate: exact match; choice: log-likelihood")
    answer_pattern: str | None = Field(None, description="generate: regex whose last match in the output is the answer")
    reference_pattern: str | None = Field(
        None,
        description="generate: regex whose last match in the item's `answer` is the reference (GSM8K: '#### (.+)')",
    )
    max_new_tokens: int = Field(32, ge=1, description="generate: tokens the model may write")
    num_fewshot: int = Field(0, ge=0, description="the file's first items, shown as solved examples (not scored)")
    chat: bool = Field(True, description="render prompts with the data's chat template (False: plain text)")
    limit: int | None = Field(None, ge=1, description="score at most this many items (after the few-shot ones)")

    @field_validator("answer_pattern", "reference_pattern")
    @classmethod
    def _compiles(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"pattern {pattern!r} is not a valid regular expression: {err}") from None
        return pattern

    @model_validator(mode="after")
    def _generate_settings_only_for_generate(self):
        if self.kind == "choice" and (self.answer_pattern or self.reference_pattern):
            raise ValueError(f"bench task {self.name}: answer_pattern and reference_pattern are for `generate` tasks")
        return self


class BenchConfig(BaseModel):
    """Benchmark tasks the `sft-bench` stage scores the tuned model (and the base, side by side) on."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    tasks: list[BenchTask] = Field([], description="local task files; none: the stage does not run")
    lm_eval_tasks: list[str] = Field(
        [], description="also these tasks of lm-evaluation-harness's registry (needs the `bench` extra)"
    )
    lm_eval_include: str | None = Field(
        None, description="a folder of lm-eval task YAMLs (for tasks over local `data_files`), added to its registry"
    )
    compare_base: bool = Field(True, description="score the base model too")
    compare_champion: bool = Field(
        True, description="also score the registry's champion (when there is one other than the tuned model)"
    )

    @model_validator(mode="after")
    def _unique_names(self):
        names = [t.name for t in self.tasks] + list(self.lm_eval_tasks)
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"bench: two tasks are named {repeated}; give each a distinct `name`")
        if self.lm_eval_tasks:
            from sftflow.tasks.eval.bench_lm_eval import require_lm_eval

            require_lm_eval()
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.tasks or self.lm_eval_tasks)


class BenchTaskFile(Manifest):
    """A task and its file's sha256: the stage's cache key holds the file's content, and a changed file is refused."""

    task: BenchTask


class LmEvalTasks(BaseModel):
    """lm-eval tasks to run, and the folder of the user's own task YAMLs with the hash of its files (the cache key
    then holds them: keep a task's local data files in that folder)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    names: list[str]
    include: str | None = None
    include_sha256: str | None = None


def resolve_lm_eval(config: BenchConfig) -> LmEvalTasks | None:
    from sftflow.tasks.core.fingerprint import sha256_tree

    if not config.lm_eval_tasks:
        return None
    include = config.lm_eval_include
    if include is not None and not Path(include).is_dir():
        raise ValueError(f"bench.lm_eval_include: folder {include} does not exist")
    return LmEvalTasks(
        names=list(config.lm_eval_tasks), include=include, include_sha256=sha256_tree(include) if include else None
    )


def resolve_tasks(config: BenchConfig) -> list[BenchTaskFile]:
    from sftflow.tasks.core.fingerprint import sha256_file

    files = []
    for task in config.tasks:
        path = Path(task.path)
        if not path.is_file():
            raise ValueError(f"bench task {task.name}: file {task.path} does not exist")
        files.append(BenchTaskFile(path=str(path.resolve()), sha256=sha256_file(path), task=task))
    return files
