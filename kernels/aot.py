"""Ahead-of-time compilation of the Triton kernels for a GPU architecture, on a machine without a GPU.

The CPU interpreter (``TRITON_INTERPRET=1``) runs a kernel's Python, so it misses what only the compiler sees: code
that does not lower (a constexpr branch whose two returns differ in shape runs in the interpreter and fails to
compile), and block shapes whose tiles and pipeline stages need more shared memory than a streaming multiprocessor
has, which fail only when launched on the GPU. Triton ships ``ptxas`` in its wheel, so compiling for sm_90 (H100 and
H200) needs no GPU. Pointers and strides are declared 16-byte aligned, as the launcher specializes them for aligned
tensors: that is what lets loads be pipelined through shared memory, and so what sets its size.

The kernels must be defined without ``TRITON_INTERPRET`` (under it ``triton.jit`` makes interpreted functions), so
callers that run under the interpreter, as the tests do, compile in a child process (`compile_in_child`):

    python -m sftflow.kernels.aot            # every shipped config: shared memory, registers and spills per kernel
    python -m sftflow.kernels.aot --json < cases.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

# Shared memory a block may opt into, in bytes, per compute capability (H100 and H200: 227 KiB).
SHARED_MEMORY = {90: 232448}


@dataclass(frozen=True)
class CompiledKernel:
    name: str  # attention: "fwd", "dq", "dkdv", "dv" or "dk"; else the kernel ("cross-entropy", "rope", ...)
    shared: int  # bytes of shared memory a program uses
    config: dict
    registers: int | None = None  # per thread (None without cuobjdump)
    stack: int | None = None  # bytes per thread: registers spilled to local memory


def resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, stack bytes) per thread of a compiled kernel, from the `cuobjdump` in Triton's wheel."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=False).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return (int(found.group(1)), int(found.group(2))) if found else (None, None)


def _describe(name: str, kernel, config: dict) -> CompiledKernel:
    return CompiledKernel(name, kernel.metadata.shared, config, *resource_usage(kernel.asm["cubin"]))


def _row(kernel: CompiledKernel) -> dict:
    """A kernel's resources as JSON (without its config, which the case already holds)."""
    return dict(name=kernel.name, shared=kernel.shared, registers=kernel.registers, stack=kernel.stack)


def compile_for(fn, types: dict[str, str], constexprs: dict, num_warps: int, num_stages: int, capability: int = 90):
    """Compile the `triton.jit` function `fn` for CUDA `capability`; `types` gives the non-constexpr arguments' types
    (``"*bf16"``, ``"fp32"``, ...; others are ``"i32"``). Returns Triton's compiled kernel (its `metadata.shared`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = types.get(name, "i32")
        if (name.endswith("_ptr") and not signature[name].startswith("tensordesc")) or name.startswith("stride"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn, signature, constexprs, attrs)
    target = GPUTarget("cuda", capability, 32)
    return triton.compile(source, target=target, options=dict(num_warps=num_warps, num_stages=num_stages))


def compile_attention(D: int, group: int, config: dict, capability: int = 90) -> list[CompiledKernel]:
    """Every kernel a forward and backward with `config` ({"fwd", "dkdv", "dq"}, as `resolve_config` gives) launches
    at head dim D and GQA group `group`, compiled for `capability`."""
    from sftflow.kernels import attention_triton as at

    block_d = at._block_d(D)
    common = dict(GROUP=group, BLOCK_D=block_d, EVEN_D=block_d == D, PRECISION="tf32")
    tensors = ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "do_ptr", "dq_ptr", "dk_ptr", "dv_ptr")
    types = {name: "*bf16" for name in tensors}
    types.update(
        {name: "*i32" for name in ("seq_start_ptr", "seq_end_ptr", "order_ptr")},
        lse_ptr="*fp32",
        delta_ptr="*fp32",
        qk_scale="fp32",
        scale="fp32",
    )

    def kernel_args(part: str) -> tuple[dict, dict, int, int]:  # a config part as the launcher passes it
        cfg = {k: v for k, v in config[part].items() if k not in ("ORDER", "SPLIT")}
        cfg["PACK"] = at.packs(cfg, group)
        cfg["TMA"] = bool(cfg.get("TMA", False)) and not cfg["PACK"] and block_d == D
        warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
        kinds = dict(types)
        if cfg["TMA"]:  # descriptors over (T, heads * D) rows, boxes of a query or a key block's rows
            for name in tensors:
                rows = cfg["BLOCK_M"] if name in ("q_ptr", "o_ptr", "do_ptr", "dq_ptr") else cfg["BLOCK_N"]
                kinds[name] = f"tensordesc<bf16[{rows}, {D}]>"
        return kinds, {**common, **cfg}, warps, stages

    out = []
    for part, fn in (("fwd", at._fwd_kernel), ("dq", at._bwd_dq_kernel)):
        kinds, constexprs, warps, stages = kernel_args(part)
        out.append(_describe(part, compile_for(fn, kinds, constexprs, warps, stages, capability), config[part]))
    kinds, constexprs, warps, stages = kernel_args("dkdv")
    passes = (("dv", 1), ("dk", 2)) if config["dkdv"].get("SPLIT", False) else (("dkdv", 0),)
    for name, part in passes:
        kernel = compile_for(at._bwd_dkdv_kernel, kinds, {**constexprs, "PART": part}, warps, stages, capability)
        out.append(_describe(name, kernel, config["dkdv"]))
    return out


def compile_other_kernels(capability: int = 90) -> list[CompiledKernel]:
    """The fused cross-entropy, RoPE and AdamW kernels at the block sizes and warps their launchers use."""
    from sftflow.kernels import adamw_triton, cross_entropy_triton, rope_triton

    out = []
    ce = cross_entropy_triton
    for has_correct in (False, True):
        types = dict(logits_ptr="*bf16", target_ptr="*i64", loss_ptr="*fp32", correct_ptr="*fp32")
        constexprs = dict(BLOCK_V=ce.BLOCK_V_MAX, HAS_CORRECT=has_correct)
        kernel = compile_for(ce._ce_loss_and_grad_kernel, types, constexprs, ce.NUM_WARPS, 3, capability)
        out.append(_describe(f"cross-entropy{' + accuracy' if has_correct else ''}", kernel, constexprs))
    constexprs = dict(BLOCK=ce.SCALE_BLOCK)
    kernel = compile_for(ce._scale_kernel, dict(x_ptr="*bf16", s_ptr="*fp32"), constexprs, 8, 3, capability)
    out.append(_describe("cross-entropy scale", kernel, constexprs))
    for transpose in (False, True):  # Llama 1B/8B: 32 heads, head dim 64 or 128
        types = dict(x_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", out_ptr="*bf16")
        constexprs = dict(BLOCK_H=32, BLOCK_HALF=64, TRANSPOSE=transpose)
        kernel = compile_for(rope_triton._rope_kernel, types, constexprs, 4, 3, capability)
        out.append(_describe(f"rope{' (transposed)' if transpose else ''}", kernel, constexprs))
    types = dict(param_ptr="*bf16", low_ptr="*i16", grad_ptr="*bf16", exp_avg_ptr="*fp32", exp_avg_sq_ptr="*fp32")
    types.update(step_ptr="*fp32", grad_scale_ptr="*fp32", found_inf_ptr="*fp32")
    types.update({name: "fp32" for name in ("lr", "beta1", "beta2", "eps", "decay", "log2_beta1", "log2_beta2")})
    constexprs = dict(SPLIT=True, HAS_GRAD_SCALE=True, HAS_FOUND_INF=True, BLOCK=adamw_triton.BLOCK)
    kernel = compile_for(adamw_triton._adamw_master_kernel, types, constexprs, adamw_triton.NUM_WARPS, 3, capability)
    out.append(_describe("adamw", kernel, constexprs))
    return out


def shipped_cases() -> list[dict]:
    """Every (head dim, GQA) config the kernels ship, for rows of short and of long documents (GQA as group 4)."""
    from sftflow.kernels.attention_triton import CONFIGS, CONFIGS_LONG

    return [
        dict(label=f"{name} D={D} {'gqa' if gqa else 'mha'}", D=D, group=4 if gqa else 1, config=config)
        for name, table in (("packed", CONFIGS), ("long", CONFIGS_LONG))
        for (D, gqa), config in table.items()
    ]


def compile_cases(cases: list[dict], capability: int = 90) -> list[dict]:
    """Compile each case ({label, D, group, config}); per case its kernels' resources, or the compiler's error."""
    out = []
    for case in cases:
        try:
            kernels = compile_attention(case["D"], case["group"], case["config"], capability)
        except Exception as err:  # noqa: BLE001 - reported per case: a config that does not lower is a finding
            out.append({**case, "error": f"{type(err).__name__}: {err}"[:2000]})
            continue
        out.append({**case, "kernels": [_row(k) for k in kernels]})
    return out


def compile_in_child(cases: list[dict], capability: int = 90, others: bool = False, timeout: float = 900) -> list[dict]:
    """`compile_cases` in a fresh Python without ``TRITON_INTERPRET`` (callable from under the interpreter); with
    `others`, a last entry labelled "others" holds `compile_other_kernels`."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "sftflow.kernels.aot", "--json", "--capability", str(capability)]
    cmd += ["--others"] if others else []
    proc = subprocess.run(
        cmd, input=json.dumps(cases), capture_output=True, text=True, env=env, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="read cases as JSON on stdin, write results as JSON")
    parser.add_argument("--capability", type=int, default=90)
    parser.add_argument("--others", action="store_true", help="with --json: also the CE, RoPE and AdamW kernels")
    args = parser.parse_args(argv)
    if args.json:
        results = compile_cases(json.load(sys.stdin), args.capability)
        if args.others:
            results.append(dict(label="others", kernels=[_row(k) for k in compile_other_kernels(args.capability)]))
        print(json.dumps(results))
        return
    limit = SHARED_MEMORY.get(args.capability)
    print(f"sm_{args.capability}: shared memory limit {limit} bytes a block")
    print("| config | kernel | tiles (M x N, warps, stages) | shared bytes | registers | spilled bytes |")
    print("|---|---|---|---|---|---|")
    for case in compile_cases(shipped_cases(), args.capability):
        if "error" in case:
            print(f"| {case['label']} | failed: {case['error'].splitlines()[0]} | | | | |")
            continue
        for k in case["kernels"]:
            cfg = case["config"][k["name"] if k["name"] in ("fwd", "dq") else "dkdv"]
            tiles = f"{cfg['BLOCK_M']} x {cfg['BLOCK_N']}, {cfg['num_warps']}, {cfg['num_stages']}"
            print(f"| {case['label']} | {k['name']} | {tiles} | {k['shared']} | {k['registers']} | {k['stack']} |")
    for k in compile_other_kernels(args.capability):
        print(f"| {k.name} | | {k.config} | {k.shared} | {k.registers} | {k.stack} |")


if __name__ == "__main__":
    main()
