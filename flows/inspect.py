"""`sftflow inspect`: documents with trained tokens highlighted, plus dataset statistics."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from sftflow.tasks.data.pbin import open_pbin

# Bold green on a terminal; visible brackets when piped, since colour codes are stripped there.
_ON, _OFF = ("\x1b[1;32m", "\x1b[0m") if sys.stdout.isatty() else ("⟦", "⟧")


def _pbin_paths(path: Path) -> tuple[list[Path], str | None]:
    """The pbin shards behind `path` and, when known, the tokenizer that made them."""
    if path.is_file():
        return [path], None
    data_json = path / "data.json"
    if data_json.is_file():
        from sftflow.flows.data import load_data_result

        result = load_data_result(path)
        return [Path(s.path) for s in result.pbin], result.tokenizer.path
    shards = sorted(path.rglob("*.pbin"))
    if not shards:
        raise ValueError(f"{path}: no .pbin file and no data.json here")
    return shards, None


def _highlight(tokenizer, ids: np.ndarray, mask: np.ndarray) -> str:
    if tokenizer is None:
        return " ".join(f"{_ON}{i}{_OFF}" if m else str(i) for i, m in zip(ids.tolist(), mask.tolist(), strict=True))
    pieces, start = [], 0
    # Decode runs of equal mask value together, so multi-token characters stay whole.
    edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    for end in [*edges.tolist(), len(ids)]:
        text = tokenizer.decode(ids[start:end].tolist(), skip_special_tokens=False)
        pieces.append(f"{_ON}{text}{_OFF}" if mask[start] else text)
        start = end
    return "".join(pieces)


def _histogram(lengths: np.ndarray, bins: int = 8) -> list[str]:
    if len(lengths) == 0:
        return []
    edges = np.unique(np.geomspace(max(1, lengths.min()), lengths.max() + 1, bins + 1).astype(np.int64))
    counts, edges = np.histogram(lengths, bins=edges)
    top = max(1, counts.max())
    rows = zip(edges[:-1], edges[1:], counts, strict=True)
    return [f"  [{lo:>6}, {hi:>6}) {c:>8} {'#' * int(40 * c / top)}" for lo, hi, c in rows]


def inspect_path(path: Path, num_docs: int, fmt: str, tokenizer: str | None, echo: Callable[[str], None]) -> None:
    if fmt not in ("text", "jsonl"):
        raise ValueError(f"--format is '{fmt}'; expected text or jsonl")
    shards, data_tokenizer = _pbin_paths(Path(path))
    files = [open_pbin(p) for p in shards]
    if fmt == "jsonl":
        for f in files:
            for i in range(len(f)):
                mask = f.loss_mask(i)
                echo(json.dumps({"source": f.source(i), "input_ids": f.doc(i).tolist(), "loss_mask": mask.tolist()}))
        return
    tok = None
    if tokenizer or data_tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer or data_tokenizer)
    else:
        echo(
            "(no tokenizer known for these shards: token ids are shown, trained ones highlighted; pass --tokenizer "
            "to see text)"
        )
    shown = 0
    for f in files:
        for i in range(min(len(f), num_docs - shown)):
            echo(f"--- {f.source(i)} ({len(f.doc(i))} tokens, trained highlighted)")
            echo(_highlight(tok, np.asarray(f.doc(i)), f.loss_mask(i).astype(bool)))
            shown += 1
    lengths = np.concatenate([np.asarray(f.doc_lengths) for f in files])
    trained = sum(int(np.asarray(f.loss_token_counts).sum()) for f in files)
    total = int(lengths.sum())
    echo("")
    fraction = trained / max(1, total)
    echo(f"shards: {len(files)}  documents: {len(lengths)}  tokens: {total}  trained fraction: {fraction:.3f}")
    if len(lengths):
        echo(f"length: min {lengths.min()}  median {int(np.median(lengths))}  max {lengths.max()}")
    echo("length histogram:")
    for line in _histogram(lengths):
        echo(line)
