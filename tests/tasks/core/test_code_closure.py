"""Stage code fingerprints come from the import closure of each stage's entry modules, not from hand-kept lists."""

from __future__ import annotations

import pytest

from sftflow.tasks.core import caching, code_closure
from sftflow.tasks.core.code_closure import code_fingerprint, import_closure, imported_modules, module_source
from sftflow.tasks.data.stage import INDEX_CACHE, PBIN_CACHE, RENDER_CACHE, SPANS_CACHE
from sftflow.tasks.eval.bench_stage import BENCH_CACHE
from sftflow.tasks.eval.stage import EVAL_CACHE
from sftflow.tasks.plan.stage import PLAN_CACHE
from sftflow.tasks.train.stage import TRAIN_CACHE

STAGES = {
    c.stage: c
    for c in (RENDER_CACHE, SPANS_CACHE, PBIN_CACHE, INDEX_CACHE, PLAN_CACHE, TRAIN_CACHE, EVAL_CACHE, BENCH_CACHE)
}


def test_closures_hold_what_each_stage_runs():
    train = set(import_closure(TRAIN_CACHE.entries))
    # Launched by name (`torchrun -m`), not imported, so it is an entry of its own; and everything it imports.
    for name in ("worker", "metrics", "export", "model", "weights", "families", "compile", "single_device", "fsdp"):
        assert f"sftflow.tasks.train.{name}" in train, name
    for kernel in ("attention", "attention_triton", "cross_entropy_triton", "rope_triton", "adamw_triton", "dispatch"):
        assert f"sftflow.kernels.{kernel}" in train, kernel
    evaluate = set(import_closure(EVAL_CACHE.entries))
    assert {"sftflow.tasks.train.model", "sftflow.tasks.tiny", "sftflow.kernels.attention"} <= evaluate
    assert "sftflow.tasks.data.render" in set(import_closure(SPANS_CACHE.entries))
    # The scoring, the task files' reader, the lm-eval runner (imported where it runs) and the model loading.
    bench = set(import_closure(BENCH_CACHE.entries))
    expected = ("bench", "bench_items", "bench_lm_eval", "evaluate", "stage")
    assert {f"sftflow.tasks.eval.{name}" for name in expected} | {"sftflow.tasks.train.model"} <= bench
    # Nothing of training or evaluation is data preparation's code.
    render = import_closure(RENDER_CACHE.entries)
    assert not any(m.startswith(("sftflow.tasks.train", "sftflow.kernels")) for m in render)


def test_changing_any_imported_module_changes_exactly_the_keys_of_the_stages_that_import_it(monkeypatch):
    """Every module of every closure, edited one at a time (a comment appended to its source, as a fix would), moves
    the key of each stage whose closure holds it and of no other stage."""
    inputs = {"work_dir": "w", "config": {"lr": 1e-3}}
    closures = {name: set(import_closure(cache.entries)) for name, cache in STAGES.items()}
    code_closure.cached_code_fingerprint.cache_clear()  # from the sources as they are now, not as first read
    before = {name: cache.key_for(inputs) for name, cache in STAGES.items()}
    for module in sorted(set().union(*closures.values())):
        edited = {module: module_source(module) + "\n# a fix\n"}
        monkeypatch.setattr(code_closure, "module_source", lambda name, e=edited: e.get(name) or module_source(name))
        code_closure.cached_code_fingerprint.cache_clear()
        for name, cache in STAGES.items():
            moved = cache.key_for(inputs) != before[name]
            assert moved == (module in closures[name]), (module, name)
    monkeypatch.undo()
    code_closure.cached_code_fingerprint.cache_clear()
    assert {name: cache.key_for(inputs) for name, cache in STAGES.items()} == before


def test_imports_are_found_at_any_depth_and_in_every_form():
    source = """
import os
import sftflow.tasks.data.pbin
from sftflow.tasks.core import fingerprint as fp
from sftflow.tasks.data import index
from sftflow.kernels.attention import varlen_attention

def later():
    from sftflow.tasks.train import config as cfg
    from .records import Record
"""
    found = imported_modules("sftflow.tasks.data.render", source)
    assert found == {
        "sftflow.tasks",
        "sftflow.tasks.core",
        "sftflow.tasks.data",
        "sftflow.tasks.data.pbin",
        "sftflow.tasks.data.index",
        "sftflow.tasks.core.fingerprint",
        "sftflow.kernels",
        "sftflow.kernels.attention",
        "sftflow.tasks.train",
        "sftflow.tasks.train.config",
        "sftflow.tasks.data.records",
    }


def test_an_unknown_entry_is_a_clear_error():
    with pytest.raises(ValueError, match="no such module"):
        code_fingerprint(("sftflow.tasks.no_such_stage",))


def test_keys_use_the_closure(monkeypatch):
    """`stage_key` reads the same fingerprint: an edit to a kernel reruns training (it did not, with a hand list)."""
    inputs = {"work_dir": "w"}
    key = caching.stage_key("train", "1", TRAIN_CACHE.entries, inputs)
    edited = "sftflow.kernels.attention_triton"
    monkeypatch.setattr(
        code_closure, "module_source", lambda name: module_source(name) + ("\n# a fix\n" if name == edited else "")
    )
    code_closure.cached_code_fingerprint.cache_clear()
    assert caching.stage_key("train", "1", TRAIN_CACHE.entries, inputs) != key
    monkeypatch.undo()
    code_closure.cached_code_fingerprint.cache_clear()
