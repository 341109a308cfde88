"""Benchmark n-grams: normalised words, the content-keyed cache, located errors, and the match rule."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

from sftflow.flows.config import load_config
from sftflow.tasks.data.decontam import Decontaminator, benchmark_ngrams
from sftflow.tasks.data.index_config import DecontamConfig, IndexConfig
from sftflow.tasks.data.ngrams import WordHasher, distinct_ngrams, mix64, words
from tests.tasks.text_filter_data import chat, sentence, write_benchmark


def reference_ngrams(text: str, n: int) -> set[int]:
    """The documented n-gram hash, one n-gram at a time, with Python integers."""
    mask = (1 << 64) - 1
    ws = words(text)
    out = set()
    for i in range(len(ws) - n + 1):
        acc = 0
        for w in ws[i : i + n]:
            acc = (
                acc * 0x100000001B3 + int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little")
            ) & mask
        out.add(int(mix64(np.array([acc], dtype=np.uint64))[0]))
    return out


def test_ngrams_ignore_case_punctuation_and_spacing_and_match_the_reference():
    hasher = WordHasher()
    a = distinct_ngrams(hasher.text("The cat, sat on the HAT!  Then: it left."), 3)
    b = distinct_ngrams(hasher.text("the cat sat on the hat then it left"), 3)
    assert np.array_equal(a, b) and len(a) == 7
    assert set(a.tolist()) == reference_ngrams("the cat sat on the hat then it left", 3)
    assert not np.array_equal(a, distinct_ngrams(hasher.text("the cat sat on the mat then it left"), 3))
    assert len(distinct_ngrams(hasher.text("too short"), 3)) == 0


def test_benchmark_set_is_cached_by_content_and_rebuilt_when_it_changes(tmp_path):
    rng = np.random.default_rng(0)
    items = [{"question": sentence(rng, 20), "answer": sentence(rng, 15)} for _ in range(3)]
    bench = write_benchmark(tmp_path / "bench.jsonl", items)
    config = DecontamConfig(action="drop", benchmarks=[str(bench)])
    cache = tmp_path / "cache"

    first = benchmark_ngrams([bench], config, cache)
    assert not first.reused
    assert first.counts == {"files": 1, "items": 3, "texts": 6, "too_short": 0, "ngrams": 3 * (8 + 3)}
    # The same contents under another name: read back, not rebuilt.
    moved = shutil.copy(bench, tmp_path / "moved.jsonl")
    again = benchmark_ngrams([moved], config, cache)
    assert again.reused and again.dir == first.dir and np.array_equal(again.ngrams, first.ngrams)
    assert again.item(0, 3) == f"{moved}:3"  # items are named by the files given now
    # Another n, or other contents: another set.
    assert benchmark_ngrams([bench], config.model_copy(update={"ngram": 8}), cache).dir != first.dir
    write_benchmark(bench, items[:2])
    changed = benchmark_ngrams([bench], config, cache)
    assert not changed.reused and changed.dir != first.dir and changed.counts["items"] == 2
    # A damaged cache is rebuilt, not trusted.
    (first.dir / "ngrams.npy").write_bytes(b"x")
    assert not benchmark_ngrams([moved], config, cache).reused


def test_bad_benchmark_records_are_named_by_file_line_and_field(tmp_path):
    config = DecontamConfig(action="drop", benchmarks=["b.jsonl"])
    bad = [
        ('{"question": "q"}\n{"prompt": "p"}\n', r"b\.jsonl:2: none of the fields .* \(it has \['prompt'\]\)"),
        ('{"question": true}\n', r"b\.jsonl:1: field 'question' must be a string, a number or a list of them"),
        ('\n{"text": "a"}\n{oops\n', r"b\.jsonl:3: not valid JSON"),
    ]
    for text, message in bad:
        (tmp_path / "b.jsonl").write_text(text)
        with pytest.raises(ValueError, match=message):
            benchmark_ngrams([tmp_path / "b.jsonl"], config, tmp_path / "cache")
    with pytest.raises(ValueError, match="missing.jsonl: benchmark file not found"):
        benchmark_ngrams([tmp_path / "missing.jsonl"], config, tmp_path / "cache")
    with pytest.raises(ValueError, match="list the benchmark files"):
        DecontamConfig(action="flag")


def test_a_document_counts_from_min_matches_shared_ngrams(tmp_path):
    rng = np.random.default_rng(1)
    question, choices = sentence(rng, 16), [sentence(rng, 14), sentence(rng, 14)]
    bench = write_benchmark(
        tmp_path / "mc.jsonl", [{"question": sentence(rng, 16)}, {"question": question, "choices": choices}]
    )
    config = DecontamConfig(action="drop", benchmarks=[str(bench)])
    decontaminator = Decontaminator(benchmark_ngrams([bench], config, tmp_path / "cache"), config)

    def check(text: str):
        return decontaminator.check(WordHasher().text(text))

    planted = chat(question.upper().replace(" ", ", "), "the answer is 4")
    match = check(planted)
    assert match is not None and match.matches == 16 - 13 + 1 and match.item_position == (0, 2)
    assert check(chat(choices[1], "")).matches == 2  # a multiple-choice option is an item's text too
    # Twelve words of it are not a 13-gram; other words between break the n-grams.
    assert check(chat(" ".join(question.split()[:12]), sentence(rng, 30))) is None
    assert check(" ".join(w + " x" for w in question.split())) is None
    strict = config.model_copy(update={"min_matches": 5})
    strict_check = Decontaminator(benchmark_ngrams([bench], strict, tmp_path / "cache"), strict).check
    assert strict_check(WordHasher().text(planted)) is None


def test_benchmark_paths_in_a_run_config_are_relative_to_it(tmp_path):
    (tmp_path / "evals").mkdir()
    (tmp_path / "run.yaml").write_text(
        "data:\n  sources: [a.jsonl]\n  tokenizer: tok\n"
        "  index: {decontaminate: {action: flag, benchmarks: [evals/gsm8k.jsonl]}, near_dedup: {enabled: true}}\n"
    )
    index = load_config(tmp_path / "run.yaml").data.index
    assert index.decontaminate.benchmarks == [str(tmp_path / "evals" / "gsm8k.jsonl")]
    assert index.reads_text and not IndexConfig().reads_text
    with pytest.raises(ValueError, match=r"'data.index.near_dedup.threshold': Input should be less than or equal to 1"):
        load_config(tmp_path / "run.yaml", {"data.index.near_dedup.threshold": "1.5"})


def test_sft_bench_task_files_serve_as_benchmark_files(tmp_path):
    """A choice task's answer is an index and a generate task's may be a number: read as their text, so the same task
    files that sft-bench scores decontaminate the training data."""
    from sftflow.tasks.demo import write_demo_bench

    paths = write_demo_bench(tmp_path / "bench")
    assert any(isinstance(json.loads(line)["answer"], int) for line in paths["capitals"].read_text().splitlines())
    config = DecontamConfig(action="flag", benchmarks=[str(p) for p in paths.values()], ngram=3)
    ngrams = benchmark_ngrams(list(paths.values()), config, tmp_path / "cache")
    assert ngrams.counts["items"] == sum(len(p.read_text().splitlines()) for p in paths.values())
    question = json.loads(paths["capitals"].read_text().splitlines()[0])["question"]
    assert Decontaminator(ngrams, config).check(WordHasher().text(f"Here it is: {question}"))
