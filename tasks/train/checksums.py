"""sha256 of every file of a DCP checkpoint, written with it and checked before it is loaded.

A flipped byte in a `.distcp` file otherwise loads silently (a weight of 9.5e35 reaches the export), and `.metadata`
is a pickle that torch's reader unpickles: its hash is checked against the listing before anything reads it. The
listing (`CHECKSUMS`, `sha256  name` per line, as the stage folders have) is written by rank 0 after every rank has
hashed its share of the files, and before `latest` names the checkpoint. The launcher checks the checkpoint a run
will load before it starts the workers, so a damaged one is one located error, not a worker traceback. This
catches corruption, not an attacker who can rewrite the listing too: checkpoints, like `init_from`, are trusted input.
A checkpoint without a listing is refused unless the user says they trust it (`train.checkpoint.trust`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from sftflow.tasks.core.atomic import write_atomic
from sftflow.tasks.core.fingerprint import sha256_file

log = logging.getLogger(__name__)

CHECKSUMS = "CHECKSUMS"


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(value):
    rank, world = _rank_world()
    if world == 1:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def _files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.is_file() and p.name != CHECKSUMS)


def write_checksums(path: Path) -> None:
    """Hash the checkpoint's files (each rank a share) and write `CHECKSUMS` on rank 0. A collective."""
    rank, world = _rank_world()
    names = _files(path)
    digests = {name: sha256_file(path / name) for name in names[rank::world]}
    merged = {k: v for part in _gather(digests) for k, v in part.items()}
    if rank == 0:
        write_atomic(path / CHECKSUMS, "".join(f"{merged[name]}  {name}\n" for name in sorted(merged)))


def verify_checksums(path: Path, trust_unverified: bool = False, resuming: bool = False) -> None:
    """Raise `ValueError` naming the first file of the checkpoint whose sha256 differs from `CHECKSUMS` (or that is
    missing, or not listed). A checkpoint without `CHECKSUMS` is refused unless `trust_unverified` (`train.
    checkpoint.trust`): torch's reader unpickles its `.metadata`, so deleting the listing must not be a way past the
    check. `resuming`: `path` is the checkpoint its own run resumes from (what the error advises). A collective when
    a process group is up (each rank checks a share, all raise together); the launcher calls it in one process."""
    path = Path(path)
    listing = path / CHECKSUMS
    if not listing.is_file():
        if trust_unverified:
            log.warning("%s has no %s: loaded unchecked, as train.checkpoint.trust allows", path, CHECKSUMS)
            return
        raise ValueError(
            f"checkpoint {path} has no {CHECKSUMS}, so its files cannot be checked, and loading it unpickles its "
            ".metadata (which can run code); if you wrote it yourself (an older sftflow, or by hand) and trust it, "
            "set train.checkpoint.trust: true (--set train.checkpoint.trust=true)"
        )
    expected = {}
    for line in listing.read_text().splitlines():
        if line.strip():
            digest, name = line.split("  ", 1)
            expected[name] = digest
    unlisted = sorted(set(_files(path)) - set(expected))
    if unlisted:
        raise ValueError(f"checkpoint {path} is damaged: {path / unlisted[0]} is not in {listing}")
    rank, world = _rank_world()
    bad = None
    for name in sorted(expected)[rank::world]:
        file = path / name
        if not file.is_file():
            bad = f"{file} is missing"
            break
        if sha256_file(file) != expected[name]:
            bad = f"{file} does not match its sha256 in {listing}"
            break
    problems = [b for b in _gather(bad) if b]
    if problems:
        raise ValueError(f"checkpoint {path} is damaged: {problems[0]}; {way_back(path, resuming)}")


def way_back(path: Path, resuming: bool) -> str:
    """What a user can do about the damaged checkpoint `path`: go back to an earlier complete one in its folder,
    where `keep_last` kept one, or else (a resume) train the run again from step 0."""
    step = _step_number(path.name)
    earlier = sorted(
        (p for p in path.parent.iterdir() if (p / ".metadata").is_file() and -1 < _step_number(p.name) < step),
        key=lambda p: _step_number(p.name),
    )
    if earlier:
        newest = earlier[-1].name
        if resuming:
            latest = path.parent / "latest"
            return f"to resume from {newest}, the newest earlier checkpoint, write '{newest}' into {latest}"
        return f"load {path.parent / newest}, the newest earlier checkpoint, instead"
    if resuming:
        return (
            f"no earlier checkpoint is kept in {path.parent} (keep_last keeps the newest only), so the run cannot "
            f"resume: train it again from step 0 (remove {path.parent}, or train into a new out folder)"
        )
    return f"no earlier checkpoint is kept in {path.parent}: load another run's checkpoint, or train without init_from"


def _step_number(name: str) -> int:
    """N of a `step-N` folder name, -1 for any other name."""
    number = name.removeprefix("step-")
    return int(number) if name.startswith("step-") and number.isdigit() else -1
