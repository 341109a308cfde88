"""Data prep throughput: sftflow render → spans vs HF `apply_chat_template(..., return_assistant_tokens_mask=True)`.

Runs on one core (tokenizer parallelism off) over the largest conversational dataset in ../shared/data
(sharegpt-zh-1k), or over generated conversations when that is absent. Both sides use the same tokenizer and the
same generation-tagged template (the built-in chatml); the baseline is given the already-normalised messages, so its
time excludes reading and format conversion, while ours includes reading, rendering, tokenizing and writing.

    python benchmarks/data_prep.py [--tokenizer DIR] [--limit N] [--record]
"""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SFTFLOW_SHARED_DATA", REPO.parent / "shared" / "data"))


def _generated(path: Path, count: int = 1000) -> Path:
    rng = random.Random(0)
    words = "the answer is a number café 日本語 🙂 reverse string hello world tool call".split()
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            turns = []
            for _ in range(rng.randint(1, 6)):
                turns.append({"from": "human", "value": " ".join(rng.choices(words, k=rng.randint(5, 60)))})
                turns.append({"from": "gpt", "value": " ".join(rng.choices(words, k=rng.randint(5, 300)))})
            f.write(json.dumps({"conversations": turns}, ensure_ascii=False) + "\n")
    return path


def _tokenizer(path: str | None, work: Path):
    from transformers import AutoTokenizer

    from sftflow.tasks.chat_template import builtin_template_text

    if path is None:
        shared = SHARED / "tokenizers" / "smollm2-135m-chatml"
        if shared.is_dir():
            path = str(shared)
        else:
            from sftflow.tasks.tiny import train_tokenizer

            texts = [line for line in open(work / "data.jsonl", encoding="utf-8")][:200]
            train_tokenizer(texts, work / "tok", vocab_size=2000)
            path = str(work / "tok")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = builtin_template_text("chatml")
    tokenizer.save_pretrained(work / "tok-chatml")
    return tokenizer, work / "tok-chatml"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer")
    parser.add_argument("--limit", type=int, default=0, help="use only the first N records (0: all)")
    parser.add_argument("--repeats", type=int, default=3, help="report the best of N runs")
    parser.add_argument("--record", action="store_true", help="append the result to benchmarks/RESULTS.md")
    args = parser.parse_args()

    import transformers

    from sftflow.tasks.formats import RecordError, normalize_record
    from sftflow.tasks.render import RenderConfig, render_source, resolve_template
    from sftflow.tasks.spans import SpansConfig, tokenize_rendered_shard

    work = Path(tempfile.mkdtemp(prefix="sftflow-bench-"))
    source = SHARED / "datasets" / "sharegpt-zh-1k" / "sharegpt_zh_1K_format.jsonl"
    name = "sharegpt-zh-1k"
    if not source.exists():
        source, name = _generated(work / "generated.jsonl"), "generated-1k"
    lines = source.read_text(encoding="utf-8").splitlines()
    if args.limit:
        lines = lines[: args.limit]
    (work / "data.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    tokenizer, tokenizer_dir = _tokenizer(args.tokenizer, work)

    render_config = RenderConfig(format="sharegpt", template="chatml", on_bad_record="reject")
    spans_config = SpansConfig(bos="never", eos="never")
    template = resolve_template(render_config, tokenizer_dir)
    ours_s = render_s = float("inf")
    for _ in range(args.repeats):  # best of N: the machine may be shared
        start = time.perf_counter()
        render_stats = render_source(work / "data.jsonl", work / "rendered.jsonl", render_config, template)
        rendered_at = time.perf_counter()
        span_stats = tokenize_rendered_shard(work / "rendered.jsonl", tokenizer, spans_config, work / "tokens.npz")
        ours_s = min(ours_s, time.perf_counter() - start)
        render_s = min(render_s, rendered_at - start)

    conversations = []
    for i, line in enumerate(lines):
        try:
            conversations.append(normalize_record(json.loads(line), "sharegpt", f"{i}").messages)
        except RecordError:
            pass
    base_s = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        baseline_tokens = 0
        for messages in conversations:
            out = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            baseline_tokens += len(out["input_ids"])
        base_s = min(base_s, time.perf_counter() - start)

    n = render_stats.rendered
    rows = [
        ("sftflow render+spans", n / ours_s, span_stats.tokens / ours_s),
        ("HF apply_chat_template", len(conversations) / base_s, baseline_tokens / base_s),
    ]
    ratio = rows[0][1] / rows[1][1]
    header = f"data_prep on {name}: {n} conversations, {span_stats.tokens} tokens, one core of {_cpu_name()}"
    versions = f"python {platform.python_version()}, transformers {transformers.__version__}"
    print(header)
    print(versions)
    print(f"{'pipeline':<26}{'conv/s':>12}{'tokens/s':>14}")
    for label, conv_s, tok_s in rows:
        print(f"{label:<26}{conv_s:>12.1f}{tok_s:>14.0f}")
    print(f"ratio (ours / baseline): {ratio:.2f}x; of our time, render {render_s:.2f}s, spans {ours_s - render_s:.2f}s")
    if args.record:
        with open(REPO / "benchmarks" / "RESULTS.md", "a", encoding="utf-8") as f:
            date = time.strftime("%Y-%m-%d")
            f.write(f"\n## Data preparation: render + spans vs HF ({date})\n\n{header}; {versions}\n\n")
            f.write("| pipeline | conv/s | tokens/s |\n|---|---|---|\n")
            for label, conv_s, tok_s in rows:
                f.write(f"| {label} | {conv_s:.1f} | {tok_s:.0f} |\n")
            f.write(f"\nratio: {ratio:.2f}x (target 3x); render {render_s:.2f}s, spans {ours_s - render_s:.2f}s\n")
    sys.exit(0)


if __name__ == "__main__":
    main()
