"""Texts for the text-filter tests: random sentences over made-up words (no two share a long n-gram), benchmark
items, and rendered + pbin shards written by hand so each document's text is known."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from sftflow.tasks.data.pbin import write_pbin
from sftflow.tasks.data.records import TokenizedDoc

VOCAB = [f"w{i}" for i in range(2000)]


def sentence(rng: np.random.Generator, n: int) -> str:
    return " ".join(VOCAB[i] for i in rng.integers(0, len(VOCAB), n))


def change_words(text: str, positions: list[int]) -> str:
    """`text` with the words at `positions` replaced by words no sentence uses."""
    ws = text.split()
    for p in positions:
        ws[p] = f"changed{p}"
    return " ".join(ws)


def chat(user: str, assistant: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant}<|im_end|>\n"


def write_benchmark(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


def write_shard(folder: Path, name: str, texts: list[str], skipped: tuple[int, ...] = ()) -> tuple[Path, Path]:
    """`folder/name.rendered.jsonl` with every text and `folder/name.pbin` with all but the `skipped` ones (as the
    spans stage drops records), each document `name.jsonl:<line>` with token ids unique to it."""
    folder.mkdir(parents=True, exist_ok=True)
    rendered, pbin = folder / f"{name}.rendered.jsonl", folder / f"{name}.pbin"
    rows = [
        {"text": t, "train_char_spans": [[0, len(t)]], "source": f"{name}.jsonl:{i + 1}"} for i, t in enumerate(texts)
    ]
    rendered.write_text("".join(json.dumps(r) + "\n" for r in rows))
    docs = []
    for i, r in enumerate(rows):
        if i not in skipped:
            ids = np.frombuffer(r["source"].encode().ljust(24, b"."), dtype=np.uint8).astype(np.int64)
            docs.append(TokenizedDoc(ids, np.array([[0, len(ids)]], dtype=np.int32), r["source"]))
    write_pbin(pbin, docs, 300, {})
    return rendered, pbin
