"""`sft-data` with decontamination and near-duplicate removal on Prefect's real engine: planted benchmark copies and
near-variants leave the index, counted per source; a refresh that adds data reuses the benchmark n-gram cache."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sftflow.flows.config import DataConfig, SFTConfig
from sftflow.flows.data import sft_data
from tests.flows.conftest import task_states
from tests.tasks.text_filter_data import change_words, sentence, write_benchmark

pytestmark = pytest.mark.slow


def _write(path: Path, pairs: list[tuple[str, str]]) -> Path:
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in pairs]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_planted_benchmark_items_are_dropped_and_the_benchmark_cache_is_reused(tmp_path, tiny_tokenizer_dir):
    rng = np.random.default_rng(0)
    items = [{"question": sentence(rng, 20), "answer": sentence(rng, 15)} for _ in range(3)]
    bench = write_benchmark(tmp_path / "bench.jsonl", items)
    clean = [(sentence(rng, 12), sentence(rng, 100)) for _ in range(10)]
    a = list(clean)
    a[3] = ("Q: " + items[0]["question"], "42")  # a.jsonl:4
    b = [(sentence(rng, 12), sentence(rng, 40)) for _ in range(5)]
    b[2] = (clean[6][0], change_words(clean[6][1], [50]))  # b.jsonl:3, near a.jsonl:7 (Jaccard ~0.9)
    sources = [str(_write(tmp_path / "a.jsonl", a)), str(_write(tmp_path / "b.jsonl", b))]
    index = {"eval_fraction": 0.0, "decontaminate": {"action": "drop", "benchmarks": [str(bench)]}}
    index["near_dedup"] = {"enabled": True}
    work = str(tmp_path / "work")

    def run(srcs):
        config = DataConfig(sources=srcs, tokenizer=str(tiny_tokenizer_dir), render={"template": "chatml"}, index=index)
        state = sft_data(config=SFTConfig(work_dir=work, data=config), return_state=True)
        return state.result(), task_states(state)

    result, _ = run(sources)
    assert result.index.num_train == 15 - 2
    assert result.index.dropped["contaminated"] == 1 and result.index.dropped["near_duplicate"] == 1
    assert result.index.filtered_by_source == {
        "a.jsonl": {"contaminated": 1, "near_duplicate": 0},
        "b.jsonl": {"contaminated": 0, "near_duplicate": 1},
    }
    assert result.summary()["filtered_by_source"] == result.index.filtered_by_source
    rejects = [json.loads(line) for line in (result.index.dir / "rejects.jsonl").read_text().splitlines()]
    assert [(r["source"], r["reason"]) for r in rejects] == [
        (f"{sources[0]}:4", "contaminated"),
        (f"{sources[1]}:3", "near_duplicate"),
    ]
    assert rejects[0]["benchmark"] == f"{bench}:1" and rejects[1]["kept"] == f"{sources[0]}:7"
    (cache,) = (Path(work) / "benchmarks").iterdir()
    built = (cache / "benchmark.json").stat().st_mtime_ns

    # A refresh with a new source (one more planted item): the index reruns, the benchmark set is read back.
    c = _write(tmp_path / "c.jsonl", [(sentence(rng, 12), sentence(rng, 40)), ("x", items[2]["answer"])])
    result, states = run([*sources, str(c)])
    assert states["index"] == ["Completed"] and states["render"].count("Cached") == 2
    assert sorted(states["textscan"]) == ["Cached", "Cached", "Completed"]  # only the new shard is scanned
    assert result.index.filtered_by_source["c.jsonl"] == {"contaminated": 1, "near_duplicate": 0}
    assert result.index.num_train == 15 - 2 + 1
    assert [p.name for p in (Path(work) / "benchmarks").iterdir()] == [cache.name]
    assert (cache / "benchmark.json").stat().st_mtime_ns == built


def test_a_missing_benchmark_file_is_one_line_naming_it(tmp_path, tiny_tokenizer_dir):
    source = _write(tmp_path / "a.jsonl", [("hi", "hello")])
    index = {"decontaminate": {"action": "drop", "benchmarks": [str(tmp_path / "gsm8k.jsonl")]}}
    config = DataConfig(
        sources=[str(source)], tokenizer=str(tiny_tokenizer_dir), render={"template": "chatml"}, index=index
    )
    with pytest.raises(ValueError, match=r"gsm8k\.jsonl: benchmark file not found \(data\.index\.decontaminate"):
        sft_data(config=SFTConfig(work_dir=str(tmp_path / "work"), data=config))
