"""Per-source eval metrics add up to the totals, and the promotion gate can refuse a per-source regression."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sftflow.tasks.core.manifests import EvalMetrics, PromoteConfig, SourceMetrics
from sftflow.tasks.eval.evaluate import masked_metrics
from sftflow.tasks.eval.promotion import decide
from sftflow.tasks.eval.report import plot_source_losses, source_rows
from sftflow.tasks.train.model import build_model

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}


def _docs(seed: int = 0, n: int = 12):
    rng = np.random.default_rng(seed)
    docs, sources = [], []
    for i in range(n):
        length = int(rng.integers(6, 30))
        start = int(rng.integers(1, length - 2))
        docs.append((rng.integers(0, 97, size=length), np.array([[start, length]], dtype=np.int32)))
        sources.append(["chat", "code", "math"][i % 3])
    return docs, sources


def test_per_source_metrics_add_up_to_the_totals_and_match_each_source_alone():
    torch.manual_seed(0)
    model = build_model("tiny-llama", vocab_size=97, packed=False, overrides=TINY)
    docs, sources = _docs()
    total = masked_metrics(model, docs, sources)
    assert sorted(total.by_source) == ["chat", "code", "math"]
    parts = total.by_source.values()
    assert sum(p.loss_tokens for p in parts) == total.loss_tokens
    assert sum(p.docs for p in parts) == len(docs)
    assert sum(p.loss * p.loss_tokens for p in parts) / total.loss_tokens == pytest.approx(total.loss, rel=1e-6)
    assert sum(p.token_accuracy * p.loss_tokens for p in parts) / total.loss_tokens == pytest.approx(
        total.token_accuracy, rel=1e-6
    )
    for name in ("chat", "code", "math"):
        alone = masked_metrics(model, [d for d, s in zip(docs, sources, strict=True) if s == name])
        assert total.by_source[name].loss == pytest.approx(alone.loss, rel=1e-6)
        assert total.by_source[name].loss_tokens == alone.loss_tokens
    assert masked_metrics(model, docs).by_source == {}  # no sources given: no breakdown


def _metrics(loss: float, **by_source: float) -> EvalMetrics:
    return EvalMetrics(
        loss=loss,
        perplexity=float(np.exp(loss)),
        token_accuracy=0.5,
        loss_tokens=300,
        by_source={k: SourceMetrics(loss=v, token_accuracy=0.5, loss_tokens=100, docs=4) for k, v in by_source.items()},
    )


def test_the_gate_refuses_a_model_that_is_better_overall_but_regresses_on_one_source():
    champion = _metrics(1.00, chat=1.0, code=1.0, math=1.0)
    candidate = _metrics(0.95, chat=0.85, code=1.05, math=0.95)  # better overall, 5% worse on code
    ok, _ = decide(candidate, champion, PromoteConfig())
    assert ok  # the default rule looks at the overall loss only
    ok, reasons = decide(candidate, champion, PromoteConfig(max_source_regression=0.01))
    assert not ok
    assert any(r.startswith("source code: loss 1.0500 is more than 1.0% above the champion's 1.0000") for r in reasons)
    ok, _ = decide(candidate, champion, PromoteConfig(max_source_regression=0.06))
    assert ok


def test_the_report_has_a_table_and_a_plot_per_source(tmp_path):
    from sftflow.tasks.eval.evaluate import EvalResult

    metrics = {"base": _metrics(2.0, chat=2.1, code=1.9), "tuned": _metrics(1.0, chat=1.2, code=0.8)}
    rows = source_rows(metrics)
    assert rows[0] == "| source | docs | base loss | tuned loss | base token acc | tuned token acc |"
    assert rows[2] == "| chat | 4 | 2.1000 | 1.2000 | 50.0% | 50.0% |"
    png = plot_source_losses(EvalResult(metrics=metrics, examples=[]), tmp_path / "source_loss.png")
    assert png is not None and png.stat().st_size > 1000
    single = {"tuned": _metrics(1.0, chat=1.0)}
    assert source_rows(single) == [] and plot_source_losses(EvalResult(single, []), tmp_path / "x.png") is None


def test_a_small_eval_sample_covers_every_source(tmp_path):
    from sftflow.tasks.data.index import build_index
    from sftflow.tasks.data.pbin import write_pbin
    from sftflow.tasks.data.reader import IndexedDataset
    from sftflow.tasks.data.records import TokenizedDoc
    from sftflow.tasks.eval.stage import eval_items

    rng = np.random.default_rng(0)
    paths = []
    for name, n in (("big", 400), ("small", 40)):
        docs = [
            TokenizedDoc(input_ids=rng.integers(0, 97, size=12), loss_spans_S2=np.array([[2, 12]], np.int32),
                         source=f"{name}.jsonl:{i + 1}")
            for i in range(n)
        ]  # fmt: skip
        write_pbin(tmp_path / f"{name}.pbin", docs, vocab_size=97, provenance={})
        paths.append(tmp_path / f"{name}.pbin")
    build_index(paths, tmp_path / "index", eval_fraction=0.5, shard_sources=["big", "small"])
    dataset = IndexedDataset(tmp_path / "index", split="eval")
    first_in_order = {dataset.source_names[s] for s in dataset.source_ids[:32]}
    assert first_in_order == {"big"}  # the index lists the big source first: its first 32 are all "big"
    items = eval_items(dataset, 32)
    assert len(items) == 32 and np.all(np.diff(items) > 0)
    assert {dataset.source_names[s] for s in dataset.source_ids[items]} == {"big", "small"}
    assert eval_items(dataset, None).tolist() == list(range(len(dataset)))

    build_index(paths[:1], tmp_path / "one", eval_fraction=0.5)
    one = IndexedDataset(tmp_path / "one", split="eval")
    assert eval_items(one, 32).tolist() == list(range(32))  # one source: the first documents, as before


def test_per_tag_metrics_add_up_to_the_totals_and_untagged_documents_are_their_own_row():
    torch.manual_seed(0)
    model = build_model("tiny-llama", vocab_size=97, packed=False, overrides=TINY)
    docs, sources = _docs(seed=1)
    tags = [["easy", "hard", "(none)", "hard"][i % 4] for i in range(len(docs))]
    total = masked_metrics(model, docs, sources, tags)
    assert sorted(total.by_tag) == ["(none)", "easy", "hard"]
    parts = total.by_tag.values()
    assert sum(p.loss_tokens for p in parts) == total.loss_tokens
    assert sum(p.loss * p.loss_tokens for p in parts) / total.loss_tokens == pytest.approx(total.loss, rel=1e-6)
    hard = masked_metrics(model, [d for d, t in zip(docs, tags, strict=True) if t == "hard"])
    assert total.by_tag["hard"].loss == pytest.approx(hard.loss, rel=1e-6)
    assert total.by_tag["hard"].token_accuracy == pytest.approx(hard.token_accuracy, rel=1e-6)
    assert total.by_source == masked_metrics(model, docs, sources).by_source  # tags leave the source rows alone
    rows = source_rows({"tuned": total}, by="tag")
    assert rows[0] == "| tag | docs | tuned loss | tuned token acc |" and len(rows) == 5
