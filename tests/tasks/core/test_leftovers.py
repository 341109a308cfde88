"""What killed writers leave behind is removed by the next run that owns the folder, and no removal follows a
symbolic link out of the folder: the link goes, what it points to stays."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from sftflow.tasks.core.atomic import is_temporary, temporary_writer
from sftflow.tasks.core.leftovers import remove, remove_stale_temporaries
from sftflow.tasks.train.checkpoint import prune_checkpoints

KILLED_WRITER = """
import sys, time
from sftflow.tasks.core.atomic import atomic_writer
with atomic_writer(sys.argv[1], "w") as f:
    f.write("half a file")
    f.flush()
    print("writing", flush=True)
    time.sleep(120)
"""


def killed_writer_leftover(target: Path) -> Path:
    """The temporary file of a real writer SIGKILLed while it wrote `target`."""
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(target)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "writing"
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    (leftover,) = [p for p in target.parent.iterdir() if is_temporary(p)]
    assert temporary_writer(leftover) == (socket.gethostname(), writer.pid)
    return leftover


def test_only_the_temporaries_of_gone_writers_on_this_host_are_removed(tmp_path):
    out = tmp_path / "render" / "key"
    out.mkdir(parents=True)
    dead = killed_writer_leftover(out / "rendered.jsonl")
    live = out / f".shard.pbin~{socket.gethostname()}~{os.getpid()}~abc.tmp"  # a writer that still runs: this one
    live.write_text("being written")
    elsewhere = out / ".shard.pbin~another-host~1~abc.tmp"  # PIDs of another host say nothing here
    elsewhere.write_text("theirs")
    finished = out / "rendered.jsonl.rejects.jsonl"
    finished.write_text("{}\n")

    assert remove_stale_temporaries(tmp_path / "render") == [dead]
    assert sorted(p.name for p in out.iterdir()) == sorted([live.name, elsewhere.name, finished.name])


def test_taking_the_work_dir_removes_the_top_level_temporaries_of_gone_writers(tmp_path):
    """A write of `data.json` or `plan.json` killed at the top of the work folder: the next flow that takes the
    folder removes its temporary; a live writer's, another host's, other files and the stage folders stay."""
    from sftflow.flows.results import work_dir_lock

    work = tmp_path / "work"
    stage = work / "render" / "key"
    stage.mkdir(parents=True)
    dead_data = killed_writer_leftover(work / "data.json")
    killed_plan = killed_writer_leftover(tmp_path / "aside" / "plan.json")  # another killed writer, moved in
    dead_plan = killed_plan.rename(work / killed_plan.name)
    live = work / f".plan.json~{socket.gethostname()}~{os.getpid()}~abc.tmp"
    live.write_text("being written")
    elsewhere = work / ".data.json~another-host~1~abc.tmp"
    elsewhere.write_text("theirs")
    hidden = work / ".notes.tmp"  # hidden and .tmp, but not a tagged name: not sftflow's to remove
    hidden.write_text("mine")
    below = stage / f".rendered.jsonl~{socket.gethostname()}~{dead_data.name.split('~')[2]}~abc.tmp"
    below.write_text("left to the stage that owns this folder")
    (work / "data.json").write_text("{}")

    with work_dir_lock(work):
        pass

    assert not dead_data.exists() and not dead_plan.exists()
    assert live.exists() and elsewhere.exists() and hidden.exists() and below.exists()
    assert (work / "data.json").read_text() == "{}"


def test_a_stale_temporary_that_is_a_link_loses_the_link_not_its_target(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not ours")
    out = tmp_path / "work" / "run"
    out.mkdir(parents=True)
    gone_pid = killed_writer_leftover(out / "metrics.jsonl").name.split("~")[2]
    link = out / f".hf~{socket.gethostname()}~{gone_pid}~abc.tmp"
    link.symlink_to(outside, target_is_directory=True)
    # A linked folder is not entered either: a stale name inside it is not the run's to remove.
    inside = outside / f".x~{socket.gethostname()}~{gone_pid}~abc.tmp"
    inside.write_text("not ours either")
    (out / "linked").symlink_to(outside, target_is_directory=True)

    removed = remove_stale_temporaries(out)
    assert link in removed and not link.is_symlink()
    assert (outside / "keep.txt").read_text() == "not ours" and inside.is_file()


def test_pruning_removes_a_linked_checkpoint_as_a_link(tmp_path):
    elsewhere = tmp_path / "elsewhere" / "step-2"
    elsewhere.mkdir(parents=True)
    (elsewhere / ".metadata").write_bytes(b"")
    (elsewhere / "__0_0.distcp").write_bytes(b"weights")
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "step-2").symlink_to(elsewhere, target_is_directory=True)
    (checkpoints / "step-4").mkdir()
    (checkpoints / "step-4" / ".metadata").write_bytes(b"")

    assert prune_checkpoints(checkpoints, keep_last=1, current=4) == [2]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-4"]
    assert (elsewhere / "__0_0.distcp").read_bytes() == b"weights"


def test_remove_deletes_files_folders_and_links_without_following_them(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "a").write_text("a")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "inner-link").symlink_to(target, target_is_directory=True)
    remove(folder)
    assert not folder.exists() and (target / "a").is_file()
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    remove(link)
    assert not link.is_symlink() and (target / "a").is_file()
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    remove(dangling)
    assert not dangling.is_symlink()
    remove(tmp_path / "never-there")


def test_a_rerun_export_removes_a_linked_staging_folder_as_a_link(tmp_path):
    """An export (a rerun, or a forced one) starts by removing what a killed export left in `.hf.writing`; when that
    is a link to a folder elsewhere, the link goes and the folder keeps its files."""
    from sftflow.tasks.train.export import export_hf
    from tests.tasks.train.test_export import _model

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"someone else's weights")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".hf.writing").symlink_to(outside, target_is_directory=True)
    model = _model("llama3_untied")
    out = export_hf(dict(model.state_dict()), model.config, run / "hf", tokenizer=None)
    assert (out / "model.safetensors").is_file() and not (run / ".hf.writing").exists()
    assert (outside / "model.safetensors").read_bytes() == b"someone else's weights"
