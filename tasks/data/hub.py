"""Hugging Face Hub datasets as sources: read once through `datasets` at a pinned revision, saved into the work
folder, then used like any local `datasets` folder.

`WORK_DIR/hub/<owner--name>/<revision>/<subset>/<split>/` holds the saved copy, so the revision is part of every
cache key downstream (a new revision is a new source), and a rerun reads the copy without the Hub or the network.
An id without `revision` is resolved to the Hub's current commit once and recorded in `WORK_DIR/hub/revisions.json`;
later runs use the recorded one, so a schedule does not drift to new upstream commits unless the record is removed.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from sftflow.tasks.core.atomic import temporary_name, write_atomic
from sftflow.tasks.core.leftovers import remove, remove_stale_temporaries

_LOCAL_COPY = "give a local copy instead: a JSONL/Parquet file or a `datasets.save_to_disk` folder as `path:`"


def hub_folder(work_dir: Path, hub: str, revision: str, subset: str | None, split: str) -> Path:
    return Path(work_dir) / "hub" / hub.replace("/", "--") / revision / (subset or "default") / split


def resolve_revision(hub: str, revision: str | None, work_dir: Path, logger: logging.Logger) -> str:
    """`revision`, else the one recorded for `hub`, else the Hub's current commit (recorded for next time)."""
    if revision:
        if not re.fullmatch(r"[0-9a-f]{40}", revision):
            logger.warning(
                "hub dataset %s: revision %r is not a commit sha; a branch or tag can move upstream, and the copy "
                "saved for it is reused until the config names another revision",
                hub,
                revision,
            )
        return revision
    record = Path(work_dir) / "hub" / "revisions.json"
    known = json.loads(record.read_text()) if record.is_file() else {}
    if hub in known:
        return known[hub]
    try:
        from huggingface_hub import HfApi

        sha = HfApi().dataset_info(hub).sha
    except Exception as err:  # noqa: BLE001 -- offline, unknown id, no access: one message says what to do
        reason = f"{type(err).__name__}: {err}".splitlines()[0]
        raise ValueError(
            f"hub dataset {hub}: no `revision` is pinned and the Hub cannot resolve one ({reason}); pin `revision:` "
            f"(a commit sha) or {_LOCAL_COPY}"
        ) from None
    record.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(record, json.dumps({**known, hub: sha}, indent=2) + "\n")
    logger.info("hub dataset %s: resolved to revision %s, recorded in %s (pin it in the config)", hub, sha, record)
    return sha


def materialize(
    hub: str, revision: str, subset: str | None, split: str, work_dir: Path, logger: logging.Logger
) -> Path:
    """The saved copy of `hub` at `revision` (read through `datasets` the first time)."""
    folder = hub_folder(work_dir, hub, revision, subset, split)
    if (folder / "state.json").is_file():  # save_to_disk writes it last; the folder is renamed in whole anyway
        return folder
    import datasets

    where = f"hub dataset {hub} (revision {revision}, subset {subset or 'default'}, split {split})"
    try:
        dataset = datasets.load_dataset(hub, name=subset, split=split, revision=revision)
    except Exception as err:  # noqa: BLE001 -- network, id, split: the message names the source and the way out
        reason = f"{type(err).__name__}: {err}".splitlines()[0]
        raise ValueError(f"{where} cannot be read ({reason}); without network, {_LOCAL_COPY}") from None
    if datasets.config.HF_HUB_OFFLINE:
        logger.warning(
            "%s: offline, read from the local datasets cache, which does not record revisions; check that it holds %s",
            where,
            revision,
        )
    remove_stale_temporaries(folder.parent)
    aside = temporary_name(folder)
    dataset.save_to_disk(str(aside))
    try:
        os.rename(aside, folder)
    except OSError:  # another run saved it first
        remove(aside)
    logger.info("%s: %d records saved to %s", where, len(dataset), folder)
    return folder
