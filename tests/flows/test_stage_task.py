"""`stage_task`: the one helper every stage task is made with, run on Prefect's real engine."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from prefect import flow

from sftflow.tasks.core.caching import CHECKSUMS, MANIFEST, StageCache, outputs_valid, read_manifest
from sftflow.tasks.core.fingerprint import sha256_file
from sftflow.tasks.core.manifests import Manifest
from sftflow.tasks.core.stage import stage_task

# Any real module will do as the entry: the key needs a code fingerprint.
TOY_CACHE = StageCache(stage="toy", version="1", entries=("sftflow.tasks.core.stage",))


class ToyOut(Manifest):
    words: int


@stage_task(TOY_CACHE, name="toy")
def toy_task(out_dir: Path, source: Manifest, upper: bool, work_dir: str, suffix: str = "!") -> ToyOut:
    # Counts its own runs in a file beside the work dir, so a test sees whether Prefect reused the cached result.
    runs = Path(work_dir) / "runs.txt"
    runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
    text = Path(source.path).read_text()
    out = out_dir / "out.txt"
    out.write_text((text.upper() if upper else text) + suffix)
    return ToyOut(path=str(out), sha256=sha256_file(out), words=len(text.split()))


def _source(tmp_path: Path, text: str = "hello stage world") -> Manifest:
    path = tmp_path / "in.txt"
    path.write_text(text)
    return Manifest(path=str(path), sha256=sha256_file(path))


def test_the_task_signature_is_the_function_without_out_dir():
    params = list(inspect.signature(toy_task.fn).parameters)
    assert params == ["source", "upper", "work_dir", "suffix"]
    assert "out_dir" not in toy_task.fn.__annotations__


def test_writes_the_manifest_and_checksums_and_reuses_the_cached_result(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    source = _source(tmp_path)

    @flow
    def run_twice():
        first = toy_task(source, True, str(work))
        # Keyword form and the default given explicitly bind to the same inputs: one key, one folder, no second run.
        second = toy_task(source=source, upper=True, work_dir=str(work), suffix="!")
        return first, second

    first, second = run_twice()
    assert first == second
    out_dir = Path(first.path).parent
    assert out_dir == TOY_CACHE.output_dir({"source": source, "upper": True, "work_dir": str(work), "suffix": "!"})
    assert Path(first.path).read_text() == "HELLO STAGE WORLD!"
    assert read_manifest(out_dir, ToyOut) == first
    listed = {line.split("  ", 1)[1] for line in (out_dir / CHECKSUMS).read_text().splitlines()}
    assert listed == {"out.txt", MANIFEST}
    assert outputs_valid(out_dir)
    assert (work / "runs.txt").read_text() == "x"

    # Another argument is another key and another folder.
    @flow
    def run_other():
        return toy_task(source, False, str(work))

    other = run_other()
    assert Path(other.path).parent != out_dir
    assert Path(other.path).read_text() == "hello stage world!"
    assert (work / "runs.txt").read_text() == "xx"


def test_an_input_manifest_whose_file_changed_is_refused_before_the_stage_runs(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    source = _source(tmp_path)
    Path(source.path).write_text("edited after its manifest was written")

    @flow
    def run():
        return toy_task(source, True, str(work))

    with pytest.raises(ValueError, match="content changed since the Manifest manifest was written"):
        run()
    assert not (work / "runs.txt").exists()


def test_a_stage_function_must_take_out_dir_first_and_work_dir():
    with pytest.raises(TypeError, match="first parameter is `out_dir`"):

        @stage_task(TOY_CACHE, name="bad")
        def no_out_dir(work_dir: str) -> None: ...

    with pytest.raises(TypeError, match="takes `work_dir`"):

        @stage_task(TOY_CACHE, name="bad")
        def no_work_dir(out_dir: Path, x: int) -> None: ...


def test_a_rerun_removes_what_a_killed_writer_of_the_stage_left_in_its_folder(tmp_path):
    """A writer SIGKILLed mid-write leaves its hidden temporary file; the next run of the stage removes it (its
    writer is gone), and leaves a live writer's (this process's) alone."""
    import os
    import socket

    from tests.tasks.core.test_leftovers import killed_writer_leftover

    work = tmp_path / "work"
    source = _source(tmp_path)
    out_dir = TOY_CACHE.output_dir({"source": source, "upper": True, "work_dir": str(work), "suffix": "!"})
    out_dir.mkdir(parents=True)
    leftover = killed_writer_leftover(out_dir / "out.txt")
    live = out_dir / f".out.txt~{socket.gethostname()}~{os.getpid()}~abc.tmp"
    live.write_text("being written")

    @flow
    def run_once():
        return toy_task(source, True, str(work))

    run_once()
    assert not leftover.exists() and live.is_file()
    assert sorted(p.name for p in out_dir.iterdir()) == sorted([CHECKSUMS, MANIFEST, "out.txt", live.name])
