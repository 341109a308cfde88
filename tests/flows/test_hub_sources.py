"""Hub datasets as sources, without network: a dataset id at a pinned revision is read through `datasets` from a
local datasets cache (the layout a first download leaves), saved in the work folder, and reruns Cached without the
cache; an unpinned id, or one that is not cached, fails with one line saying to pin it or use a local copy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sftflow.tasks.demo import write_demo
from tests.flows.conftest import run_cli

pytestmark = pytest.mark.slow

HUB_ID = "sftflow-tests/tiny-chats"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def _datasets_cache(jsonl: Path, cache: Path) -> None:
    """A datasets cache holding HUB_ID, as `load_dataset(HUB_ID)` leaves it after a download: the same builder output,
    under the dataset's cache name."""
    script = "import datasets, sys; datasets.load_dataset('json', data_files=sys.argv[1], split='train')"
    env = dict(os.environ, HF_DATASETS_CACHE=str(cache), HF_HUB_OFFLINE="1")
    subprocess.run([sys.executable, "-c", script, str(jsonl)], env=env, check=True, capture_output=True)
    owner, name = HUB_ID.split("/")
    (config,) = (cache / "json").iterdir()
    target = cache / f"{owner}___{name}" / "default"
    target.parent.mkdir(parents=True)
    shutil.move(str(config), str(target))
    for arrow in target.glob("*/*/json-train*.arrow"):
        arrow.rename(arrow.with_name(arrow.name.replace("json-train", f"{name}-train")))


def _config(folder: Path, demo: dict, source: dict) -> Path:
    path = folder / "hub.yaml"
    config = {
        "work_dir": "work",
        "data": {"sources": [source], "tokenizer": str(demo["tokenizer"]), "render": {"template": "chatml"}},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_pinned_hub_dataset_is_read_once_and_reruns_cached(tmp_path, monkeypatch):
    demo = write_demo(tmp_path / "demo", n=40)
    cache = tmp_path / "hf-datasets"
    _datasets_cache(Path(demo["data"]), cache)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = _config(tmp_path, demo, {"hub": HUB_ID, "revision": REVISION})

    first = run_cli("data", "--config", str(config))
    assert first.returncode == 0, first.stdout + first.stderr
    saved = tmp_path / "work" / "data" / "hub" / "sftflow-tests--tiny-chats" / REVISION / "default" / "train"
    assert (saved / "state.json").is_file()
    result = json.loads((tmp_path / "work" / "data" / "data.json").read_text())
    assert result["rendered"][0]["source_path"] == str(saved) and result["rendered"][0]["num_records"] == 40
    assert json.loads(Path(result["index"]["path"]).read_text())["sources"] == [HUB_ID]

    shutil.rmtree(cache)  # the rerun needs neither the Hub nor the datasets cache
    again = run_cli("data", "--config", str(config))
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads((tmp_path / "work" / "data" / "data.json").read_text())["index"] == result["index"]
    assert "Cached" in again.stdout + again.stderr

    # Another revision is another source: it must be read again, and here it cannot be.
    other = _config(tmp_path, demo, {"hub": HUB_ID, "revision": "f" * 40})
    failed = run_cli("data", "--config", str(other))
    assert failed.returncode == 2
    message = failed.stdout + failed.stderr
    assert f"hub dataset {HUB_ID} (revision {'f' * 40}, subset default, split train) cannot be read" in message
    assert "give a local copy instead" in message and "Traceback" not in message


def test_an_unpinned_hub_id_offline_asks_for_a_revision(tmp_path, monkeypatch):
    demo = write_demo(tmp_path / "demo", n=10)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    failed = run_cli("data", "--config", str(_config(tmp_path, demo, {"hub": HUB_ID})))
    assert failed.returncode == 2
    message = failed.stdout + failed.stderr
    assert f"hub dataset {HUB_ID}: no `revision` is pinned and the Hub cannot resolve one" in message
    assert "pin `revision:`" in message and "Traceback" not in message
