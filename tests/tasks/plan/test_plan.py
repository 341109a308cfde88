from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from sftflow.tasks.plan.planner import PlanConfig, cost_coefficients_from_model, load_plan, plan, save_plan
from sftflow.tasks.train.collate import collate, packed_collator, padded_collator
from sftflow.tasks.train.mock import MockConfig, MockDataset


def _lognormal(n, capacity, seed=0, median=None):
    rng = np.random.default_rng(seed)
    median = median or capacity / 12
    return np.clip(np.rint(rng.lognormal(np.log(median), 1.0, n)), 1, capacity).astype(np.int64)


def _rows(arrays):
    return [arrays.doc_ids[arrays.row_ptr[i] : arrays.row_ptr[i + 1]] for i in range(len(arrays.row_ptr) - 1)]


def _check_plan(arrays, lengths, loss, cfg):
    n, m = arrays.num_ranks, arrays.micro_batches_per_step
    rows = _rows(arrays)
    per_step = n * m
    assert len(rows) == arrays.num_steps * per_step
    assert arrays.doc_ids.dtype == np.int64 and arrays.row_ptr.dtype == np.int64
    # capacity per mode
    for docs in rows:
        if cfg.mode == "packed":
            assert lengths[docs].sum() <= cfg.tokens_per_rank
        elif cfg.mode == "padded":
            assert len(docs) == 0 or len(docs) * lengths[docs].max() <= cfg.tokens_per_rank
        else:
            assert len(docs) <= 1
    # every doc exactly once per epoch, or dropped
    planned_epochs = np.repeat(arrays.epoch_of_step, per_step)
    dropped = np.bincount(arrays.dropped_doc_ids, minlength=len(lengths))
    for epoch in range(cfg.epochs):
        docs = [d for docs, e in zip(rows, planned_epochs, strict=True) if e == epoch for d in docs]
        counts = np.bincount(np.array(docs, dtype=np.int64), minlength=len(lengths))
        assert ((counts == 1) | ((counts == 0) & (dropped > 0))).all()
    assert dropped.sum() == len(arrays.dropped_doc_ids)
    # per-step trainable targets = sum over the step's rows
    for step in range(arrays.num_steps):
        docs = np.concatenate([d for mb in arrays.step_rows(step) for d in mb]).astype(np.int64)
        assert arrays.step_loss_tokens[step] == loss[docs].sum()
        assert arrays.step_tokens[step] == lengths[docs].sum()


@settings(max_examples=60, deadline=None)
@given(
    num_docs=st.integers(1, 300),
    capacity=st.sampled_from([16, 64, 1000]),
    num_ranks=st.integers(1, 5),
    micro_batches=st.integers(1, 3),
    epochs=st.integers(1, 2),
    mode=st.sampled_from(["packed", "padded", "iterative"]),
    drop_last=st.booleans(),
    seed=st.integers(0, 3),
)
def test_plan_properties(num_docs, capacity, num_ranks, micro_batches, epochs, mode, drop_last, seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, capacity, size=num_docs, endpoint=True)
    loss = rng.integers(0, lengths, endpoint=True)
    cfg = PlanConfig(
        num_ranks=num_ranks, tokens_per_rank=capacity, micro_batches_per_step=micro_batches, epochs=epochs,
        mode=mode, drop_last=drop_last, seed=seed,
    )  # fmt: skip
    arrays, stats = plan(lengths, loss, cfg)
    _check_plan(arrays, lengths, loss, cfg)
    assert stats.num_steps == arrays.num_steps and sum(stats.steps_per_epoch) == arrays.num_steps
    if not drop_last:
        assert stats.dropped_docs == 0


def test_iterative_yields_each_doc_alone_in_order():
    lengths = np.array([5, 3, 9, 1, 7])
    cfg = PlanConfig(num_ranks=2, tokens_per_rank=10, mode="iterative", shuffle=False)
    arrays, _ = plan(lengths, lengths - 1, cfg)
    assert [r.tolist() for r in _rows(arrays)] == [[0], [1], [2], [3], [4], []]
    assert arrays.epoch_of_step.tolist() == [0, 0, 0]


def test_plan_is_byte_identical(tmp_path):
    lengths = _lognormal(3000, 2048, seed=1)
    cfg = PlanConfig(num_ranks=4, tokens_per_rank=2048, micro_batches_per_step=2, epochs=2, seed=7)
    save_plan(plan(lengths, lengths - 1, cfg)[0], tmp_path / "a.npz")
    save_plan(plan(lengths, lengths - 1, cfg)[0], tmp_path / "b.npz")
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "b.npz").read_bytes()
    save_plan(plan(lengths, lengths - 1, cfg.model_copy(update={"seed": 8}))[0], tmp_path / "c.npz")
    assert (tmp_path / "a.npz").read_bytes() != (tmp_path / "c.npz").read_bytes()


def test_save_load_roundtrip(tmp_path):
    lengths = _lognormal(500, 512)
    arrays, _ = plan(lengths, lengths // 2, PlanConfig(num_ranks=3, tokens_per_rank=512, mode="padded"))
    save_plan(arrays, tmp_path / "plan.npz")
    loaded = load_plan(tmp_path / "plan.npz")
    with np.load(tmp_path / "plan.npz", allow_pickle=False) as data:
        assert int(data["num_ranks"]) == 3 and int(data["micro_batches_per_step"]) == 1
        assert data["doc_ids"].dtype == np.int64 and data["row_ptr"].dtype == np.int64
    for name in ("doc_ids", "row_ptr", "step_loss_tokens", "epoch_of_step", "row_max_seqlen"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(arrays, name))
    assert (loaded.num_ranks, loaded.mode, loaded.steps_per_epoch) == (3, "padded", arrays.num_steps)


def test_resume_from_step_k_needs_nothing_before_k():
    """The plan is a pure function of (lengths, config): a later epoch, a truncated plan and the rows read at a
    resumed step are the same whatever happened before step k."""
    lengths = _lognormal(2000, 1024, seed=2)
    cfg = PlanConfig(num_ranks=4, tokens_per_rank=1024, micro_batches_per_step=2, epochs=3, seed=5)
    full, _ = plan(lengths, lengths - 1, cfg)
    one_epoch, _ = plan(lengths, lengths - 1, cfg.model_copy(update={"epochs": 1}))
    rows_per_epoch0 = one_epoch.num_steps * 8
    assert [r.tolist() for r in _rows(full)[:rows_per_epoch0]] == [r.tolist() for r in _rows(one_epoch)]
    k = full.num_steps // 2
    truncated, _ = plan(lengths, lengths - 1, cfg.model_copy(update={"max_steps": k}))
    assert truncated.num_steps == k
    assert [r.tolist() for r in _rows(truncated)] == [r.tolist() for r in _rows(full)[: k * 8]]
    np.testing.assert_array_equal(truncated.step_loss_tokens, full.step_loss_tokens[:k])
    resumed = [[d.tolist() for d in mb] for s in range(k, full.num_steps) for mb in full.step_rows(s)]
    flat = [r.tolist() for r in _rows(full)[k * 8 :]]
    assert [d for mb in resumed for d in mb] == flat


def test_packing_quality_on_lognormal():
    lengths = _lognormal(40_000, 4096, seed=3, median=300)
    cfg = PlanConfig(num_ranks=8, tokens_per_rank=4096, micro_batches_per_step=2)
    _, stats = plan(lengths, lengths - 1, cfg)
    assert stats.efficiency >= 0.99
    assert stats.token_imbalance <= 1.05 and stats.cost_imbalance <= 1.05
    assert stats.cost_imbalance_p99 <= 1.05


def test_final_partial_step_spreads_over_all_ranks():
    lengths = np.full(12, 100)  # 12 docs of 100 tokens, 1000-token rows: 2 rows if packed tightly
    cfg = PlanConfig(num_ranks=4, tokens_per_rank=1000, micro_batches_per_step=1)
    arrays, stats = plan(lengths, lengths - 1, cfg)
    assert arrays.num_steps == 1
    assert [len(r) for r in _rows(arrays)] == [3, 3, 3, 3]
    dropped, dstats = plan(lengths, lengths - 1, cfg.model_copy(update={"drop_last": True}))
    assert dropped.num_steps == 0 and dstats.dropped_docs == 12


def test_empty_rows_when_fewer_docs_than_ranks():
    arrays, stats = plan(np.array([5, 6]), np.array([4, 5]), PlanConfig(num_ranks=4, tokens_per_rank=8))
    assert sorted(len(r) for r in _rows(arrays)) == [0, 0, 1, 1]
    assert stats.num_empty_rows == 2


def test_target_tokens_per_step():
    lengths = np.full(1000, 100)
    cfg = PlanConfig(num_ranks=2, tokens_per_rank=1000, target_tokens_per_step=8000)
    arrays, _ = plan(lengths, lengths, cfg)
    assert arrays.micro_batches_per_step == 4  # 1000 trainable tokens per row, 2 rows per micro-batch


def test_step_loss_tokens_match_collated_batches():
    ds = MockDataset(MockConfig(num_docs=200, vocab_size=300, median_length=40, max_length=256, loss_spans=True))
    for mode, fns in (("packed", packed_collator()), ("padded", padded_collator())):
        cfg = PlanConfig(num_ranks=2, tokens_per_rank=256, micro_batches_per_step=2, mode=mode)
        arrays, _ = plan(ds.lengths, ds.loss_token_counts, cfg)
        for step in range(arrays.num_steps):
            total = 0
            for mb in arrays.step_rows(step):
                for docs in mb:
                    batch = collate([ds[int(i)] for i in docs], fns)
                    assert batch["input_ids"].numel() <= 256
                    total += batch["num_loss_tokens"]
            assert total == arrays.step_loss_tokens[step]


def test_errors_name_the_problem():
    with pytest.raises(
        ValueError,
        match=r"doc 2 has 900 tokens, more than a row holds \(tokens_per_rank=512\); raise plan.tokens_per_rank",
    ):
        config = PlanConfig(num_ranks=1, tokens_per_rank=512, too_long="error")
        plan(np.array([10, 20, 900]), np.array([1, 1, 1]), config)
    with pytest.raises(ValueError, match=r"\(every document is\)"):
        plan(np.array([600, 900]), np.array([1, 1]), PlanConfig(num_ranks=1, tokens_per_rank=512))
    with pytest.raises(ValueError, match=r"doc 1: loss_token_counts=30"):
        plan(np.array([10, 20]), np.array([1, 30]), PlanConfig(num_ranks=1, tokens_per_rank=512))
    with pytest.raises(ValidationError, match="not both"):
        PlanConfig(num_ranks=1, tokens_per_rank=8, micro_batches_per_step=2, target_tokens_per_step=10)


def test_documents_longer_than_a_row_are_left_out_with_a_count_and_a_warning(caplog):
    """Real data has a long tail: by default a document longer than a row is dropped from every epoch, counted in the
    stats and named (the longest) in one warning, instead of failing the run after the data stage."""
    import logging

    lengths = np.array([10, 20, 900, 30, 700])
    config = PlanConfig(num_ranks=1, tokens_per_rank=512, epochs=2, seed=0)
    with caplog.at_level(logging.WARNING):
        arrays, stats = plan(lengths, np.ones(5, dtype=np.int64), config, describe=lambda d: f"chats.jsonl:{d + 1}")
    assert stats.too_long_docs == 2
    assert sorted(set(arrays.doc_ids.tolist())) == [0, 1, 3]
    assert np.bincount(arrays.doc_ids).tolist()[:4] == [2, 2, 0, 2]  # each kept document once an epoch
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "2 document(s) longer than a row (tokens_per_rank=512) left out, the longest chats.jsonl:3" in warning
    kept, _ = plan(lengths[[0, 1, 3]], np.ones(3, dtype=np.int64), config)
    assert kept.num_steps == arrays.num_steps


def test_cost_coefficients_from_model():
    # Llama-3.2-1B shape
    a, b = cost_coefficients_from_model(2048, 16, 32, 64, 8192, 128256, num_kv_heads=8)
    assert 30_000 < a / b < 45_000
    cfg = PlanConfig(num_ranks=1, tokens_per_rank=4096, cost_per_token=a, cost_per_token_pair=b)
    assert cfg.cost_coefficients == (a, b)
    assert PlanConfig(num_ranks=1, tokens_per_rank=4096).cost_coefficients == (1.0, 1 / 4096)
