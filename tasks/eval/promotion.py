"""The promotion gate: evaluate a newly trained model and the registry's champion on the same eval documents, and
promote the new one only if it is better by the configured rule (`PromoteConfig`). Plain functions; the Prefect task
and flow are in `sftflow.flows.promote`."""

from __future__ import annotations

import json
from pathlib import Path

from sftflow.tasks.core.atomic import write_atomic
from sftflow.tasks.core.manifests import (
    BenchReport,
    DatasetIndex,
    EvalConfig,
    EvalMetrics,
    ModelRef,
    PromoteConfig,
    PromoteResult,
    TokenizerRef,
)
from sftflow.tasks.eval.hub_push import sync_champion
from sftflow.tasks.eval.registry import Registry
from sftflow.tasks.eval.report import source_rows


def decide(candidate: EvalMetrics, champion: EvalMetrics | None, config: PromoteConfig) -> tuple[bool, list[str]]:
    """Whether `candidate` replaces `champion`, and why."""
    if champion is None:
        return True, ["no champion yet: the first model is promoted"]
    reasons, ok = [], True
    bar = champion.loss * (1 - config.min_improvement)
    if candidate.loss < bar:
        reasons.append(f"loss {candidate.loss:.4f} < {bar:.4f} (champion {champion.loss:.4f})")
    else:
        ok = False
        need = f" by {config.min_improvement:.1%}" if config.min_improvement else ""
        reasons.append(f"loss {candidate.loss:.4f} does not beat the champion's {champion.loss:.4f}{need}")
    for key in ("token_accuracy", "exact_match"):
        new, old = getattr(candidate, key), getattr(champion, key)
        if new is None or old is None:
            continue
        if new < old - config.max_regression:
            ok = False
            reasons.append(f"{key} {new:.3f} fell more than {config.max_regression:.3f} below the champion's {old:.3f}")
    if config.max_source_regression is not None:
        for source, old in champion.by_source.items():
            new = candidate.by_source.get(source)
            if new is None:
                continue  # the source left the eval set; the overall rule covers what remains
            ceiling = old.loss * (1 + config.max_source_regression)
            if new.loss > ceiling:
                ok = False
                reasons.append(
                    f"source {source}: loss {new.loss:.4f} is more than {config.max_source_regression:.1%} above the "
                    f"champion's {old.loss:.4f}"
                )
    return ok, reasons


def bench_card(bench: BenchReport) -> dict:
    """The candidate's own benchmark scores, each with its task file's hash: recorded in its registry card when it is
    promoted, so the next gate compares with the champion on the same tasks."""
    report = Path(bench.path)
    files = json.loads(report.read_text(encoding="utf-8")).get("task_files", []) if report.is_file() else []
    shas = {f["name"]: f["sha256"] for f in files}
    return {
        name: {"metric": t.metric, "items": t.items, "score": t.scores["tuned"], "task_sha256": shas.get(name)}
        for name, t in bench.tasks.items()
    }


def champion_scores(champion, bench: BenchReport) -> tuple[dict[str, float] | None, str]:
    """The champion's score on each of the candidate's tasks: as sft-bench scored it beside the candidate, else as
    recorded in its card when it was promoted; None where neither has one of them (a task it was not scored on,
    another metric or item count, or an edited task file). And one line saying what the gate compares with."""
    if champion is None:
        return None, "bench: no champion yet; compared with the base"
    if bench.models.get("champion") == champion.sha256:
        scores = {name: t.scores["champion"] for name, t in bench.tasks.items()}
        return scores, f"bench: compared with champion {champion.name}, scored beside the candidate by sft-bench"
    recorded = champion.card.get("bench") or {}
    candidate = bench_card(bench)
    missing = [
        name
        for name, now in candidate.items()
        if name not in recorded or any(recorded[name].get(k) != now[k] for k in ("metric", "items", "task_sha256"))
    ]
    if missing:
        return None, (
            f"bench: champion {champion.name} has no recorded score on the same task files for {', '.join(missing)}; "
            "compared with the base"
        )
    scores = {name: float(recorded[name]["score"]) for name in candidate}
    return scores, f"bench: compared with champion {champion.name}'s recorded scores"


def decide_bench(
    bench: BenchReport, config: PromoteConfig, champion: dict[str, float] | None = None, label: str = "base"
) -> tuple[bool, list[str]]:
    """The benchmark rules: no task's score below the reference's by more than `bench_max_regression`, and the mean
    over the tasks above the reference's by at least `bench_min_mean_gain` (scores in [0, 1]: 0.01 is one point).
    The reference is `champion`'s scores (by task) when given, named `label`; else the base's."""
    reasons, ok = [], True
    reference = champion if champion is not None else {name: t.scores["base"] for name, t in bench.tasks.items()}
    if config.bench_max_regression is not None:
        for name, task in bench.tasks.items():
            tuned, base = task.scores["tuned"], reference[name]
            if tuned < base - config.bench_max_regression:
                ok = False
                reasons.append(
                    f"bench {name}: {task.metric} {tuned:.1%} fell {100 * (base - tuned):.1f} points below the "
                    f"{label}'s {base:.1%} (at most {100 * config.bench_max_regression:.1f} allowed)"
                )
    if config.bench_min_mean_gain is not None:
        tuned, base = bench.mean("tuned"), sum(reference.values()) / len(reference)
        gain = tuned - base
        verdict = "meets" if gain >= config.bench_min_mean_gain else "misses"
        ok = ok and gain >= config.bench_min_mean_gain
        reasons.append(
            f"bench mean {tuned:.1%} vs the {label}'s {base:.1%}: {100 * gain:+.1f} points {verdict} the "
            f"{100 * config.bench_min_mean_gain:+.1f} required"
        )
    return ok, reasons


def report_markdown(result: PromoteResult, candidate: str, champion_before: str | None) -> str:
    rows = ["| model | loss | ppl | token acc | exact |", "|---|---|---|---|---|"]
    for name, m in result.metrics.items():
        exact = "n/a" if m.exact_match is None else f"{m.exact_match:.1%}"
        label = f"{name} ({champion_before})" if name == "champion" else f"{name} ({candidate})"
        rows.append(f"| {label} | {m.loss:.4f} | {m.perplexity:.2f} | {m.token_accuracy:.1%} | {exact} |")
    lines = [f"# sft-promote: {result.decision}", "", *rows, "", *source_rows(result.metrics), ""]
    lines += [*[f"- {r}" for r in result.reasons], ""]
    lines.append(f"Champion now: `{result.champion}`" if result.champion else "No champion.")
    if result.hub is not None:
        hub = result.hub
        where = f"`{hub.repo}` ({hub.revision})"
        untagged = "; untagged: its version's tag already names another commit" if hub.commit and not hub.tag else ""
        lines.append(
            f"Hub: {where} holds {hub.version}"
            + (f", commit [{hub.commit}]({hub.url})" if hub.commit else "")
            + untagged
            if hub.ok
            else f"Hub: {hub.version} was not pushed to {where}: {hub.error} (the next gate retries)"
        )
    return "\n".join(lines) + "\n"


def promote(
    candidate: ModelRef,
    index: DatasetIndex,
    tokenizer: TokenizerRef,
    eval_config: EvalConfig,
    config: PromoteConfig,
    registry_root: str | Path,
    out_dir: str | Path,
    source: dict | None = None,
    bench: BenchReport | None = None,
) -> PromoteResult:
    """Compare `candidate` with the champion of the registry at `registry_root` and promote it if it wins (and, given
    the candidate's `bench` report, if it passes the benchmark rules). The registry stays locked for the whole
    comparison, so two gates never both promote against the same champion."""
    from sftflow.tasks.core.fingerprint import sha256_tree

    index.verify()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    registry = Registry(registry_root)
    sha = candidate.sha256 or sha256_tree(candidate.spec)
    if bench is not None and bench.models.get("tuned") != sha:
        raise ValueError(
            f"{bench.path}: the benchmark scores are of another model than the candidate {candidate.spec}; run "
            "sft-bench on it first"
        )
    with registry.lock():
        champion = registry.champion()
        before = champion.name if champion else None
        unchanged = champion is not None and champion.sha256 == sha
        if unchanged:
            ok, reasons, metrics = False, [f"the candidate is the champion {champion.name} (same files)"], {}
        else:
            metrics = _compare(candidate, champion, index, tokenizer, eval_config)
            ok, reasons = decide(metrics["candidate"], metrics.get("champion"), config)
            if bench is not None:
                scores, compared = champion_scores(champion, bench)
                label = "base" if scores is None else f"champion {champion.name}"
                bench_ok, bench_reasons = decide_bench(bench, config, scores, label)
                ok, reasons = ok and bench_ok, [*reasons, compared, *bench_reasons]
        now = before
        if ok:
            card = {"source": {"model": candidate.spec, **(source or {})}, "eval": metrics["candidate"].model_dump()}
            if bench is not None:
                card["bench"] = bench_card(bench)
            version = registry.publish(candidate.spec, {**card, "eval_index_sha256": index.sha256, "sha256": sha})
            registry.set_champion(version)
            now = version.name
        # Also after a kept candidate: a champion whose push failed before is pushed now.
        hub = sync_champion(registry, config.hub) if config.hub is not None else None
        result = PromoteResult(
            decision="promoted" if ok else ("unchanged" if unchanged else "kept"),
            reasons=reasons,
            champion=now,
            candidate_sha256=sha,
            metrics=metrics,
            report_path=str(out_dir / "report.md"),
            hub=hub,
        )
        entry = {"decision": result.decision, "champion": now, "previous": before, "reasons": reasons}
        registry.record({**entry, "hub": hub.model_dump()} if hub is not None else entry)
    write_atomic(out_dir / "report.md", report_markdown(result, candidate.spec, before))
    write_atomic(out_dir / "promote.json", json.dumps(result.model_dump(), indent=2))
    return result


def _compare(candidate: ModelRef, champion, index: DatasetIndex, tokenizer: TokenizerRef, eval_config: EvalConfig):
    """Metrics of the candidate and the champion (if any) on the same eval documents, by name."""
    from transformers import AutoTokenizer

    from sftflow.tasks.data.index import load_index
    from sftflow.tasks.data.reader import IndexedDataset
    from sftflow.tasks.eval.evaluate import evaluate_models
    from sftflow.tasks.eval.stage import eval_documents, load_model

    dataset = IndexedDataset(load_index(index.dir, verify=True), split="eval")
    if len(dataset) == 0:
        raise ValueError(f"{index.path}: the eval split is empty; the gate needs index.eval_fraction > 0")
    docs, sources, tags = eval_documents(dataset, eval_config.max_docs)
    models = {"candidate": load_model(candidate, dataset.vocab_size)}
    if champion is not None:
        models["champion"] = load_model(ModelRef(spec=str(champion.model_dir)), dataset.vocab_size)
    hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer.path)
    evaluated = evaluate_models(
        models, hf_tokenizer, docs, eval_config.max_generations, num_examples=0, sources=sources, tags=tags
    )
    return evaluated.metrics
