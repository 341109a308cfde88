"""Host memory and time of saving and loading the one-device path's `model` checkpoint component (its fp32 masters).

    python benchmarks/checkpoint_memory.py [--config benchmarks/workloads/llama-3.2-1b.json] [--layers 8]
                                           [--modes deferred deferred-per-tensor deferred-one-file joined]
                                           [--jsonl FILE]

Each mode runs in its own process: it builds a `MasterAdamW` over the model (bf16 parameters, the masters' low bits
and fp32 moments, as on a GPU but in host memory here), then saves the `model` component with DCP and loads it
back, after the parameters were overwritten. The numbers are the process's peak resident memory during each phase
(`VmHWM`, reset before it) minus its resident memory before it: what the save or the load adds on the host.
- `deferred` (the worker now): `MasterModelState` with `DeferredSavePlanner` / `DeferredLoadPlanner`: each master is
  joined when the writer reaches it, and split back into its parameter as soon as it is read; files of at most 1 GiB
  of tensor data (`checkpoint.storage_writer`);
- `deferred-per-tensor`: the same with a file per tensor (`storage_writer(path, file_bytes=0)`);
- `deferred-one-file`: the same with DCP's default writer (one file per rank), which keeps every tensor it wrote
  until the file closes;
- `joined` (the worker before): every master joined into a CPU tensor before DCP starts (4 bytes a parameter), and
  read back into such tensors before any is split; one file per rank.
Each checks that the loaded masters equal the saved ones. `--jsonl FILE` appends each mode's extra host memory and
seconds of the save and of the load to FILE as result rows (`harness.py`), deferred against joined.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]


def child(args) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.stateful import Stateful
    from transformers import AutoConfig, AutoModelForCausalLM

    from sftflow.tasks.train.checkpoint import storage_writer
    from sftflow.tasks.train.deferred import DeferredLoadPlanner, DeferredSavePlanner
    from sftflow.tasks.train.single_device import MasterAdamW, MasterModelState

    class JoinedModelState(Stateful):  # the worker's `model` component before the deferred entries
        def __init__(self, state: MasterModelState):
            self.inner = state

        def state_dict(self):
            names = self.inner.model.state_dict().keys()
            return {k: self.inner.optimizer.master(self.inner.params[k]).cpu() for k in names}

        def load_state_dict(self, state_dict):
            for key, value in state_dict.items():
                self.inner.optimizer.set_master(self.inner.params[key], value)

    torch.set_num_threads(2)
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.config, num_hidden_layers=args.layers)
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    optimizer = MasterAdamW(lm.parameters(), lr=1e-5, betas=(0.9, 0.95), eps=1e-8)
    optimizer.cast_parameters(torch.bfloat16)
    state = MasterModelState(lm, optimizer)
    numel = sum(p.numel() for p in lm.parameters())
    sums = {name: optimizer.master(p).double().sum().item() for name, p in lm.named_parameters()}
    path = Path(args.out) / args.mode
    writers = {"deferred": lambda: storage_writer(path), "deferred-per-tensor": lambda: storage_writer(path, 0)}
    writer = writers.get(args.mode, lambda: dcp.FileSystemWriter(str(path)))()
    if args.mode.startswith("deferred"):
        component, save_planner, load_planner = state, DeferredSavePlanner(), DeferredLoadPlanner()
    else:
        component, save_planner, load_planner = JoinedModelState(state), None, None
    base = harness.reset_peak()
    timer = harness.Timer().start()
    dcp.save({"model": component}, storage_writer=writer, planner=save_planner, no_dist=True)
    save_s, save_gib = timer.stop(), (harness.peak_bytes() - base) / 2**30
    with torch.no_grad():
        for p in lm.parameters():
            optimizer.set_master(p, torch.zeros(p.shape))
    base = harness.reset_peak()
    timer = harness.Timer().start()
    dcp.load({"model": component}, checkpoint_id=str(path), planner=load_planner, no_dist=True)
    load_s, load_gib = timer.stop(), (harness.peak_bytes() - base) / 2**30
    wrong = [n for n, p in lm.named_parameters() if optimizer.master(p).double().sum().item() != sums[n]]
    assert not wrong, f"{args.mode}: masters not restored: {wrong[:3]}"
    files = len(list(path.glob("*.distcp")))
    print(json.dumps(dict(mode=args.mode, params=numel, save_gib=save_gib, save_s=save_s, load_gib=load_gib,
                          load_s=load_s, files=files)))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(ROOT / "benchmarks" / "workloads" / "llama-3.2-1b.json"))
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (the 1B shape has 16: 20 GB to build)")
    modes = ["deferred", "deferred-per-tensor", "deferred-one-file", "joined"]
    parser.add_argument("--modes", nargs="+", default=modes)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    harness.add_common_args(parser)  # --jsonl
    args = parser.parse_args()
    if args.mode:
        return child(args)
    rows = harness.run_modes(__file__, args.modes, ["--config", args.config, "--layers", str(args.layers)])
    env = harness.environment()
    print(f"{env['machine']}, {harness.versions_line(env, 'python', 'torch')}; {Path(args.config).name} with "
          f"{args.layers} layers, the `model` component (fp32 masters) alone")  # fmt: skip
    headers = ["parameters", "files", "save: extra host GiB", "save s", "load: extra host GiB", "load s"]
    ok = harness.print_rows(rows, headers, lambda r: [
        f"{r['params'] / 1e9:.2f}B", str(r["files"]), f"{r['save_gib']:.2f}", f"{r['save_s']:.1f}",
        f"{r['load_gib']:.2f}", f"{r['load_s']:.1f}",
    ])  # fmt: skip
    if {"deferred", "joined"} <= ok.keys():
        d, j = ok["deferred"], ok["joined"]
        print(f"\ndeferred / joined: save {d['save_gib'] / j['save_gib']:.2f}x the host memory, "
              f"{d['save_s'] / j['save_s']:.2f}x the time; load {d['load_gib'] / j['load_gib']:.2f}x the host memory, "
              f"{d['load_s'] / j['load_s']:.2f}x the time")  # fmt: skip
    harness.write_rows(args.jsonl, result_rows(args, ok, env))


FIGURES = (
    ("save_gib", "save: extra host memory", "GiB"),
    ("save_s", "save time", "s"),
    ("load_gib", "load: extra host memory", "GiB"),
    ("load_s", "load time", "s"),
)


def result_rows(args, ok: dict[str, dict], env: dict) -> list[dict]:
    """Each mode that ran: the save's and the load's extra host memory and seconds, deferred against joined."""
    rows = []
    for mode, r in ok.items():
        workload = (
            f"save and load the one-device path's fp32 masters, {r['params'] / 1e9:.2f}B parameters "
            f"({Path(args.config).name}, {args.layers} layers)"
        )
        peer = ok.get("joined") if mode == "deferred" else None
        for key, metric, unit in FIGURES:
            against = {}
            if peer is not None and peer[key] > 0:
                against = dict(peer="joined", peer_value=peer[key], ratio=r[key] / peer[key], ratio_basis="this / peer")
            rows.append(harness.result_row("benchmarks/checkpoint_memory.py", mode, metric, r[key], unit, env,
                                           workload=workload, **against))  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
