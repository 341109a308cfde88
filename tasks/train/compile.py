"""Regional compilation of the decoder layers (`compile="layers"`).

Each decoder layer's `forward` goes through `torch.compile(dynamic=True)`: one graph serves every layer and every row
length, and inductor fuses the elementwise work around the matmuls (RMSNorm, RoPE, SiLU·mul, residual adds), which
is about a quarter of an eager step on a 1B model (`benchmarks/RESULTS.md`). FSDP's hooks stay outside the
compiled region. On the FlashAttention-4 and Triton backends sftflow's attention is a `torch.library` op
(`sftflow::fa4_varlen_attention`, `sftflow::varlen_attention`) that the layer's graph calls: one graph per layer, no
host time spent at a graph break, and the gradients reach the kernels as they left them. Other backends run under
`torch.compiler.disable`, a graph break in each layer.

RoPE. Llama-style `apply_rotary_pos_emb` gets `q`/`k` as (B, H, T, D) views of the projections' (B, T, H, D)
output. Inductor's fused RoPE wrote the (B, H, T, D) shape contiguously (a transposing, uncoalesced write), and its
backward ran at ~0.4 TB/s, ~9 ms of a 272 ms step on an H200 together. `_tmajor_rope` calls
`sftflow.kernels.rope.rotary` (one row-wise kernel, forward and backward, in the projections' layout, a custom op
that compiled graphs call without a break). It replaces a modeling module's function only after checking, on random
inputs, that it gives the same result as the original, so a family whose RoPE differs (partial rotary, interleaved)
is left alone.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import torch
from torch import nn

log = logging.getLogger("sftflow.train")

CompileMode = Literal["auto", "off", "layers"]


def resolve_compile(mode: CompileMode, device: torch.device) -> bool:
    """`auto` compiles on CUDA only: on CPU the compile time outweighs the gain for the tiny models run there."""
    if mode == "auto":
        return device.type == "cuda"
    return mode == "layers"


def _tmajor_rope(original):
    from sftflow.kernels.rope import rotary

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        # Not the (B, H, T, D) call this replacement is for, or a partial rotary (Phi-4-mini rotates 3/4 of each
        # head, a split the kernel does not make): the family's own function.
        if unsqueeze_dim != 1 or cos.shape[-1] != q.shape[-1]:
            return original(q, k, cos, sin, unsqueeze_dim)
        return rotary(q, cos, sin), rotary(k, cos, sin)

    return apply_rotary_pos_emb


def _same_rope(original, candidate) -> bool:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 3, 5, 8, generator=gen, dtype=torch.float64)
    cos = torch.randn(2, 5, 8, generator=gen, dtype=torch.float64)
    sin = torch.randn(2, 5, 8, generator=gen, dtype=torch.float64)
    try:
        expected = original(q, k, cos, sin)
        got = candidate(q, k, cos, sin)
    except Exception:  # a different signature or shape contract: not the Llama-style function
        return False
    return all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def patch_rope_layout(layer: nn.Module) -> bool:
    """Swap the layer's modeling module's `apply_rotary_pos_emb` for the T-major one, when provably equal."""
    module = sys.modules.get(type(layer).__module__)
    original = getattr(module, "apply_rotary_pos_emb", None)
    if original is None or not hasattr(module, "rotate_half"):
        return False
    if getattr(original, "_sftflow_tmajor", False):
        return True
    candidate = _tmajor_rope(original)
    if not _same_rope(original, candidate):
        log.info("compile: %s has its own RoPE; left as it is", module.__name__)
        return False
    candidate._sftflow_tmajor = True
    module.apply_rotary_pos_emb = candidate
    return True


def attention_in_graph(layers: list[nn.Module], device: torch.device | None, dtype: torch.dtype | None) -> str | None:
    """The backend whose `torch.library` op compiled layers call inside their graph, when the attention dispatches to
    one (FlashAttention-4 or the Triton kernels) on `device` and `dtype`; None: other backends stay behind a graph
    break."""
    if device is None or dtype is None or not layers:
        return None
    head_dim = getattr(getattr(layers[0], "self_attn", None), "head_dim", None)
    if head_dim is None:
        return None
    from sftflow.kernels.attention import IN_GRAPH, select_backend

    name = select_backend(device, dtype, head_dim).name
    return name if name in IN_GRAPH else None


def compile_layers(
    layers: list[nn.Module], strict: bool = True, device: torch.device | None = None, dtype: torch.dtype | None = None
) -> bool:
    """Compile each decoder layer's forward (call before `fully_shard`, after the attention is registered).

    `strict=False` (the worker's `compile="auto"`): a layer dynamo or inductor cannot compile runs eagerly, with
    torch's warning, instead of failing the run; `compile="layers"` asked for compilation, so there errors surface.
    `device` and `dtype` (of the training): where the attention runs on the Triton kernels, the layer's graph holds
    it (`attention_in_graph`), else it runs under `torch.compiler.disable`. Returns whether the graph holds it.
    """
    if not strict:
        torch._dynamo.config.suppress_errors = True
    from transformers import AttentionInterface

    from sftflow.tasks.train.model import ATTENTION_NAME, in_graph_attention, sftflow_varlen_attention

    backend = attention_in_graph(layers, device, dtype)
    attention = in_graph_attention(backend) if backend else torch.compiler.disable(sftflow_varlen_attention)
    AttentionInterface.register(ATTENTION_NAME, attention)
    rope = patch_rope_layout(layers[0]) if layers else False
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)
    log.info(
        "compile: %d decoder layers (dynamic shapes%s%s)",
        len(layers),
        ", T-major RoPE" if rope else "",
        f", attention ({backend}) in the graph" if backend else "",
    )
    return backend is not None
