"""Peak host memory and time of the export (`hf/`), a tensor group at a time against the whole model at once.

    python benchmarks/export_memory.py [--config benchmarks/workloads/llama-3.2-1b.json] [--dtype bf16]
                                       [--shard-gb 5] [--modes streamed whole] [--jsonl FILE]

Each mode runs in its own process. The process first builds the trained model's fp32 tensors (random values), which
on a GPU run live in device memory, so they are not counted: the number reported is the process's peak resident
memory (`ru_maxrss`) minus its resident memory once they exist, i.e. what the export itself adds on the host.
- `streamed` (the worker now): `export_streamed`, each tensor handed over as it is (the worker gathers it on the
  device and only its `dtype` copy reaches the host);
- `whole` (the worker before): an fp32 copy of every tensor on the host (`full_state_dict`), loaded into a model
  built from the config, cast to `dtype` and written by `save_pretrained`.
`--jsonl FILE` appends each mode's extra host memory and time to FILE as result rows (`harness.py`), streamed against
whole.
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]


def child(args) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from sftflow.tasks.train.export import export_streamed

    torch.set_num_threads(2)
    config = AutoConfig.from_pretrained(args.config)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    source = {name: torch.full(t.shape, 0.01, dtype=torch.float32) for name, t in meta.state_dict().items()}
    if config.tie_word_embeddings:
        source.pop("lm_head.weight", None)
    numel = sum(t.numel() for t in source.values())
    base = harness.resident_bytes()
    out = Path(args.out) / args.mode
    timer = harness.Timer().start()
    if args.mode == "streamed":
        export_streamed(source.__getitem__, config, out, tokenizer=None, dtype=args.dtype,
                        max_shard_bytes=int(args.shard_gb * 10**9))  # fmt: skip
    else:
        state = {k: v.clone() for k, v in source.items()}  # what the gather to rank 0's CPU made
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        model.load_state_dict(state, strict=False)
        target = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
        model.to(target).save_pretrained(out, max_shard_size=f"{args.shard_gb}GB")
    seconds = timer.stop()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    files = sorted(p.name for p in out.glob("*.safetensors"))
    print(json.dumps(dict(mode=args.mode, params=numel, extra_gib=(peak - base) / 2**30, seconds=seconds,
                          files=len(files), bytes=sum((out / f).stat().st_size for f in files))))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(ROOT / "benchmarks" / "workloads" / "llama-3.2-1b.json"))
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--shard-gb", type=float, default=5.0)
    parser.add_argument("--modes", nargs="+", default=["streamed", "whole"])
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    harness.add_common_args(parser)  # --jsonl
    args = parser.parse_args()
    if args.mode:
        return child(args)
    rows = harness.run_modes(
        __file__, args.modes, ["--config", args.config, "--dtype", args.dtype, "--shard-gb", str(args.shard_gb)]
    )
    env = harness.environment()
    versions = harness.versions_line(env, "python", "torch", "transformers")
    print(f"{env['machine']}, {versions}; {Path(args.config).name}, {args.dtype}, shards of {args.shard_gb} GB")
    headers = ["parameters", "extra host memory GiB", "seconds", "files", "bytes written"]
    ok = harness.print_rows(rows, headers, lambda r: [
        f"{r['params'] / 1e9:.2f}B", f"{r['extra_gib']:.2f}", f"{r['seconds']:.1f}", str(r["files"]),
        f"{r['bytes'] / 1e9:.2f} GB",
    ])  # fmt: skip
    if {"streamed", "whole"} <= ok.keys():
        print(f"\nstreamed / whole: {ok['streamed']['extra_gib'] / ok['whole']['extra_gib']:.2f}x the host memory, "
              f"{ok['streamed']['seconds'] / ok['whole']['seconds']:.2f}x the time")  # fmt: skip
    harness.write_rows(args.jsonl, result_rows(args, ok, env))


def result_rows(args, ok: dict[str, dict], env: dict) -> list[dict]:
    """Each mode that ran: its extra host memory and seconds, streamed against whole where both ran."""
    rows = []
    for mode, r in ok.items():
        workload = f"export {Path(args.config).name} ({r['params'] / 1e9:.2f}B) {args.dtype}, {args.shard_gb:g} GB"
        peer = ok.get("whole") if mode == "streamed" else None
        for key, metric, unit in (("extra_gib", "extra host memory", "GiB"), ("seconds", "export time", "s")):
            against = {}
            if peer is not None and peer[key] > 0:
                against = dict(peer="whole", peer_value=peer[key], ratio=r[key] / peer[key], ratio_basis="this / peer")
            rows.append(harness.result_row("benchmarks/export_memory.py", mode, metric, r[key], unit, env,
                                           workload=workload + " shards", **against))  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
