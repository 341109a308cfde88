"""Reading a benchmark task file and turning its items into prompts (see `bench_config` for the file format).

A prompt is the item's question, after the task's few-shot items as solved examples: with the chat template, as
alternating user/assistant turns ending in the generation prompt; as plain text, `question\\nanswer\\n\\n` blocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sftflow.tasks.data.chat_template import ChatTemplate
from sftflow.tasks.eval.bench_config import BenchTask


@dataclass(frozen=True)
class BenchItem:
    line: int  # 1-based line in the task file
    question: str
    answer: str  # generate: the reference text; choice: the right choice's text
    choices: tuple[str, ...] = ()
    subset: str | None = None  # the item's group in per-subset tables (MMLU's subject, say)

    @property
    def correct_choice(self) -> int:
        return self.choices.index(self.answer)


def read_items(path: str | Path, task: BenchTask) -> list[BenchItem]:
    """Every item of `path`; a malformed one is a `ValueError` naming the file, line and field."""
    items = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not a JSON object ({err.msg}); each line holds one item") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: not a JSON object; each line holds one item")
            items.append(_item(record, task, where, line_no))
    if not items:
        raise ValueError(f"{path}: bench task {task.name} has no items")
    if len(items) <= task.num_fewshot:
        raise ValueError(
            f"{path}: bench task {task.name} has {len(items)} items, all taken as few-shot examples "
            f"(num_fewshot={task.num_fewshot}); lower num_fewshot or add items"
        )
    return items


def _item(record: dict, task: BenchTask, where: str, line_no: int) -> BenchItem:
    question = record.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: field 'question' must be a non-empty string")
    subset = record.get("subset")
    if subset is not None and (not isinstance(subset, str) or not subset.strip()):
        raise ValueError(f"{where}: field 'subset' must be a non-empty string (the item's group) or absent")
    answer = record.get("answer")
    if task.kind == "generate":
        if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
            raise ValueError(f"{where}: field 'answer' must be a string (the reference) for a generate task")
        return BenchItem(line=line_no, question=question, answer=str(answer), subset=subset)
    choices = record.get("choices")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"{where}: field 'choices' must be a list of at least two non-empty strings")
    if isinstance(answer, int) and not isinstance(answer, bool):
        if not 0 <= answer < len(choices):
            raise ValueError(f"{where}: field 'answer' is {answer}; expected an index in 0..{len(choices) - 1}")
        answer = choices[answer]
    elif not isinstance(answer, str) or answer not in choices:
        raise ValueError(f"{where}: field 'answer' must be the right choice's index or one of 'choices'")
    return BenchItem(line=line_no, question=question, answer=answer, choices=tuple(choices), subset=subset)


def split_items(items: list[BenchItem], task: BenchTask) -> tuple[list[BenchItem], list[BenchItem]]:
    """(few-shot examples, items to score)."""
    scored = items[task.num_fewshot :]
    return items[: task.num_fewshot], scored[: task.limit] if task.limit else scored


def render_prompt(item: BenchItem, fewshot: list[BenchItem], template: ChatTemplate | None) -> str:
    """The text the model continues: its answer (generate) or each choice (choice) comes right after it."""
    if template is None:
        return "".join(f"{e.question}\n{e.answer}\n\n" for e in fewshot) + f"{item.question}\n"
    messages = []
    for e in fewshot:
        messages += [{"role": "user", "content": e.question}, {"role": "assistant", "content": e.answer}]
    text, _ = template.render([*messages, {"role": "user", "content": item.question}], add_generation_prompt=True)
    return text
