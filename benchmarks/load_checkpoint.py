"""Peak host memory and time per rank to load a Hugging Face checkpoint for training, sftflow against the old way.

    python benchmarks/load_checkpoint.py [--shape llama3-1b] [--ranks 1 2 4] [--baseline-ranks 1 2] [--device cpu]
                                         [--jsonl FILE]

A random-init checkpoint of the shape is written once as bf16 safetensors in 2 files with an index, as a hub folder
is. Then, for each rank count, `torchrun` starts that many ranks, each of which:
- `sftflow`: builds the model on the meta device, shards it with FSDP2 and reads its rows of each tensor
  (`build_training_model` + `shard_model` + `materialize`, the worker's code);
- `from_pretrained` (the baseline, what the worker did before): `AutoModelForCausalLM.from_pretrained(fp32)` on every
  rank, then FSDP2.

Each rank reports its peak resident memory (`ru_maxrss`) after loading and the seconds it took; the table shows the
largest rank's, next to the target: the rank's fp32 shard (on a CPU device; nothing on a GPU device) plus the largest
tensor plus 1 GiB. `--jsonl FILE` appends the largest rank's peak and the seconds of each run to FILE as result rows
(`harness.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import harness

from sftflow.tasks.shapes import SHAPES as MODEL_SHAPES

# The shapes of `sftflow.tasks.shapes` by their command-line names, without the extras that change no load (RoPE base,
# norm epsilon, positions): llama3-1b is meta-llama/Llama-3.2-1B's structure (1.24B parameters, tied head).
SHAPES = {"llama3-1b": MODEL_SHAPES["llama3.2-1b"].structure(), "small": MODEL_SHAPES["llama-512x4"].structure()}
RESULTS = Path(__file__).with_name("RESULTS.md")
BENCHMARK = "benchmarks/load_checkpoint.py"


def write_checkpoint(shape: str, folder: Path) -> tuple[int, int]:
    """A random bf16 checkpoint of `shape` in two safetensors files plus an index; (parameters, largest tensor bytes
    in fp32). Tensors are made one at a time, so writing needs no whole model in memory."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(SHAPES[shape])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = {name: p.shape for name, p in model.named_parameters()}
    config.save_pretrained(folder)
    half = len(names) // 2
    weight_map, total, largest = {}, 0, 0
    gen = torch.Generator().manual_seed(0)
    for part, chunk in enumerate((list(names)[:half], list(names)[half:])):
        file = f"model-0000{part + 1}-of-00002.safetensors"
        tensors = {n: (torch.randn(names[n], generator=gen) * 0.02).to(torch.bfloat16) for n in chunk}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        for n, t in tensors.items():
            weight_map[n] = file
            total += t.numel()
            largest = max(largest, t.numel() * 4)
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total, largest


RANK = """
import json, os, resource, sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[4])  # benchmarks/, for the harness's timer
from harness import Timer
from sftflow.tasks.train.fsdp import init_distributed, shard_model
from sftflow.tasks.train.model import build_model, build_training_model
from sftflow.tasks.train.weights import materialize
folder, mode, device = sys.argv[1], sys.argv[2], sys.argv[3]
env = init_distributed(device)
if env.device.type == "cuda":
    torch.ones(1, device=env.device)  # the CUDA context: part of the process, not of loading
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
timer = Timer().start()  # the host's clock: loading is host work, the device synchronised below
if mode == "sftflow":
    lm, files = build_training_model(folder, vocab_size=None, packed=True)
    root = shard_model(lm, env, torch.float32)
    materialize(root, lm, env.device, files)
else:
    lm = build_model(folder, vocab_size=None, packed=True)
    root = shard_model(lm, env, torch.float32)
if env.device.type == "cuda":
    torch.cuda.synchronize()
seconds = timer.stop()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
row = {"rank": env.rank, "seconds": seconds, "peak_bytes": peak, "before_bytes": before}
print("RESULT " + json.dumps(row), flush=True)
dist.destroy_process_group()
"""


def measure(folder: Path, mode: str, ranks: int, device: str) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(RANK)
    here = str(Path(__file__).resolve().parent)
    result = subprocess.run([*cmd, f.name, str(folder), mode, device, here], env=env, capture_output=True, text=True)
    os.unlink(f.name)
    rows = [json.loads(line.split("RESULT ", 1)[1]) for line in result.stdout.splitlines() if "RESULT " in line]
    if result.returncode != 0 or len(rows) != ranks:
        return [{"error": (result.stderr or result.stdout).strip().splitlines()[-1][:200]}]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-1b", choices=sorted(SHAPES))
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--baseline-ranks", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--append-results", action="store_true")
    harness.add_common_args(parser)  # --jsonl
    args = parser.parse_args()

    env = harness.environment()
    gib, figures = 2**30, []
    with tempfile.TemporaryDirectory(prefix="sftflow-load-") as tmp:
        folder = Path(tmp)
        timer = harness.Timer().start()
        params, largest = write_checkpoint(args.shape, folder)
        print(f"wrote {params / 1e9:.2f}B parameters in {timer.stop():.0f} s", flush=True)
        lines = [
            f"### {args.shape} ({params / 1e9:.2f}B parameters, bf16 safetensors in 2 files), loaded for training on "
            f"{args.device}, {env['date']}, {env['machine']}, {harness.versions_line(env, 'torch', 'transformers')}",
            "",
            "| ranks | load | peak host memory of the largest rank (GiB) | of which before loading | target (GiB) "
            "| seconds |",
            "|---|---|---|---|---|---|",
        ]
        for mode, counts in (("sftflow", args.ranks), ("from_pretrained", args.baseline_ranks)):
            for ranks in counts:
                rows = measure(folder, mode, ranks, args.device)
                shard = params * 4 / ranks if args.device == "cpu" else 0
                target = (shard + largest) / gib + 1
                if "error" in rows[0]:
                    lines.append(f"| {ranks} | {mode} | failed: {rows[0]['error']} | | {target:.2f} | |")
                    continue
                largest_rank = max(rows, key=lambda r: r["peak_bytes"])
                peak, before = largest_rank["peak_bytes"] / gib, largest_rank["before_bytes"] / gib
                seconds = max(r["seconds"] for r in rows)
                lines.append(f"| {ranks} | {mode} | {peak:.2f} | {before:.2f} | {target:.2f} | {seconds:.1f} |")
                print(lines[-1], flush=True)
                kind = "gloo" if args.device == "cpu" else "GPU"
                row = dict(
                    env=env,
                    workload=f"load a {params / 1e9:.2f}B bf16 checkpoint, {ranks} {kind} rank(s)",
                    note=f"{args.shape} shape, bf16 safetensors in 2 files; FSDP2; target {target:.2f} GiB",
                )
                figures += [
                    harness.result_row(BENCHMARK, mode, "peak host memory, largest rank", peak, "GiB", **row),
                    harness.result_row(BENCHMARK, mode, "load time", seconds, "s", **row),
                ]
    table = "\n".join(lines) + "\n"
    print(table)
    harness.write_rows(args.jsonl, figures)
    if args.append_results:
        with open(RESULTS, "a") as f:
            f.write("\n" + table)


if __name__ == "__main__":
    if resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY:
        print("note: an address-space limit is set; peaks above it fail", file=sys.stderr)
    main()
