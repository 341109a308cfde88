"""`shard_bytes: auto` on a source over 16 MiB: it is split at line ends, records keep their true 1-based lines, and the
output is the same bytes for 1 or 2 workers and for the shard size given explicitly."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest

from sftflow.flows.config import DataConfig, SFTConfig
from sftflow.flows.data import DataResult, sft_data, task_workers
from sftflow.tasks.data.index import load_index
from sftflow.tasks.data.pbin import open_pbin
from sftflow.tasks.data.sharding import AUTO_SHARD_BYTES, AUTO_SPLIT_FROM
from sftflow.tasks.data.stage import source_files
from sftflow.tasks.demo import write_demo


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> dict[str, Path]:
    """Just over 16 MiB of long conversations: a dozen distinct ones repeated (so tokenizing stays cheap), with a
    blank line and a line that is not JSON in the last shard."""
    out = tmp_path_factory.mktemp("auto-shards")
    demo = write_demo(out / "demo", n=40)
    rng = random.Random(0)
    words = "the answer is 42 hello world weather in Paris reverse a string".split()
    distinct = []
    for i in range(12):
        answer = " ".join(rng.choices(words, k=12_000))
        messages = [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": answer}]
        distinct.append(json.dumps({"messages": messages}))
    lines = []
    while sum(len(line) + 1 for line in lines) < AUTO_SPLIT_FROM + 2**20:
        lines.append(distinct[len(lines) % len(distinct)])
    bad_at = len(lines) - 3
    lines[bad_at:bad_at] = ["", "{not json"]
    path = out / "big.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return {"data": path, "tokenizer": demo["tokenizer"], "bad_line": bad_at + 2, "lines": len(lines)}


def _run(big, work: Path, **data) -> DataResult:
    config = DataConfig(
        sources=[str(big["data"])],
        tokenizer=str(big["tokenizer"]),
        render={"template": "chatml", "on_bad_record": "reject"},
        index={"eval_fraction": 0.2},
        **data,
    )
    return sft_data(config=SFTConfig(work_dir=str(work), data=config))


def _index_arrays(result: DataResult) -> dict[str, np.ndarray]:
    index = load_index(result.index_dir)
    return {name: getattr(index, name) for name in ("shard", "doc", "length", "loss_tokens", "content_hash", "split")}


@pytest.mark.slow  # two flow runs over 17 MiB
def test_auto_shards_are_the_same_on_any_number_of_workers_and_as_given_explicitly(big, tmp_path):
    one = _run(big, tmp_path / "one", workers=1)
    two = _run(big, tmp_path / "two", workers=2)

    assert len(one.pbin) == 3  # 8 + 8 MiB and the rest
    # The shards are those of the size given explicitly: the same task inputs, so the same cached outputs.
    explicit = source_files(big["data"], shard_bytes=AUTO_SHARD_BYTES)
    assert [r.source_range for r in one.rendered] == [s.range.label for s in explicit]
    path = big["data"].resolve()
    sources = []
    for shard in one.pbin:
        with open_pbin(shard.path) as f:
            assert f.provenance["source_range"].startswith("bytes ")
            sources += [f.source(i) for i in range(len(f))]
    # Every record once, in file order, with its true 1-based line, across the shard boundaries.
    valid = [n for n in range(1, big["lines"] + 1) if n not in (big["bad_line"] - 1, big["bad_line"])]
    assert sources == [f"{path}:{n}" for n in valid]
    rejects = [json.loads(line) for r in one.rendered if r.rejects_path for line in open(r.rejects_path)]
    assert [r["source"] for r in rejects] == [f"{path}:{big['bad_line']}"]
    assert one.rendered[-1].num_rejected == 1
    assert sum(t.num_repeated for t in one.tokenized) == len(valid) - 3 * 12  # each shard tokenizes 12 texts

    # Two workers write the same bytes as one: every pbin shard and every index array.
    assert [Path(p.path).read_bytes() for p in two.pbin] == [Path(p.path).read_bytes() for p in one.pbin]
    for name, array in _index_arrays(one).items():
        np.testing.assert_array_equal(_index_arrays(two)[name], array, err_msg=name)
    paths = {"index": None, "rejects": None}  # in each run's own work folder
    assert two.summary() | paths == one.summary() | paths


def test_workers_default_to_one_per_usable_core():
    config = DataConfig(sources=["x.jsonl"], tokenizer="t")
    assert config.shard_bytes == "auto"
    assert task_workers(config) == len(os.sched_getaffinity(0))
    assert task_workers(config.model_copy(update={"workers": 3})) == 3
