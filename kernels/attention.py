"""Varlen causal attention over packed rows, with GQA: one dispatch over four backends.

A packed row holds several documents back to back; ``cu_seqlens`` gives their boundaries. Each token attends to
the tokens of its own document up to itself, never across documents::

    tokens      a0 a1 a2 b0 b1 c0          cu_seqlens = [0, 3, 5, 6], max_seqlen = 3
    a2 sees     a0 a1 a2                   (window=2: a1 a2 only, as Mistral's sliding window of 2 would)
    b1 sees              b0 b1
    c0 sees                    c0

Shapes: q (T, H, D), k and v (T, K, D) with H a multiple of K (GQA: query head h reads kv head h // (H / K)).

Backends (``SFTFLOW_ATTENTION=<name>`` forces one; otherwise the first available in the device's preference):

| backend      | needs                                             |
|--------------|---------------------------------------------------|
| ``flash_attn_4`` | flash-attn-4 (``pip install flash-attn-4``), sm_90+, fp16/bf16, head dim 8-256 (multiple of 8) |
| ``triton``   | triton and CUDA (or ``TRITON_INTERPRET=1`` on CPU); head dim <= 256 by default |
| ``flash_attn`` | the flash-attn (FlashAttention-2) package, CUDA, fp16/bf16 |
| ``torch``    | ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10), CUDA, fp16/bf16 |
| ``sdpa``     | nothing: SDPA on each document alone; the CPU reference (a Python loop over documents) |
"""

from __future__ import annotations

import importlib.util
import inspect
import math

import torch
import torch.nn.functional as F

from sftflow.kernels import dispatch

KERNEL = "attention"
ENV_VAR = "SFTFLOW_ATTENTION"
HALF = (torch.float16, torch.bfloat16)


def _flash_attn_available(device: torch.device, dtype: torch.dtype) -> str | None:
    # flash-attn-4 installs `flash_attn.cute` alone; FlashAttention-2 is the `flash_attn_2_cuda` extension.
    if importlib.util.find_spec("flash_attn_2_cuda") is None:
        return "flash_attn (FlashAttention-2) is not installed"
    if device.type != "cuda":
        return f"flash_attn needs CUDA, tensors are on {device.type}"
    if dtype not in HALF:
        return f"flash_attn needs fp16/bf16, got {dtype}"
    return None


def _torch_varlen_available(device: torch.device, dtype: torch.dtype) -> str | None:
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (needs >= 2.10)"
    if device.type != "cuda":
        return f"varlen_attn needs CUDA, tensors are on {device.type}"
    if dtype not in HALF:
        return f"varlen_attn needs fp16/bf16, got {dtype}"
    return None


def _triton_available(device: torch.device, dtype: torch.dtype) -> str | None:
    if dtype not in (*HALF, torch.float32):
        return f"the triton kernel takes fp16/bf16/fp32, got {dtype}"
    return dispatch.triton_unavailable_reason(device)


def _sdpa_available(device: torch.device, dtype: torch.dtype) -> str | None:
    return None


def _flash_attn_4_available(device: torch.device, dtype: torch.dtype) -> str | None:
    from sftflow.kernels.attention_fa4 import unavailable_reason

    return unavailable_reason(device, dtype)


BACKENDS = {
    "flash_attn_4": _flash_attn_4_available,
    "flash_attn": _flash_attn_available,
    "triton": _triton_available,
    "torch": _torch_varlen_available,
    "sdpa": _sdpa_available,
}
# CUDA order from benchmarks/RESULTS.md (## Kernels): on an H100, FlashAttention-4 ran forward+backward faster than
# sftflow's Triton kernels on every measured shape (packed and long documents, head dims 64, 128 and 256), so it
# comes first where it installs (Hopper and newer); the Triton kernels ran 1.35-1.69x faster than torch varlen_attn
# (FlashAttention-2 inside torch) at D=64 and D=128 on the H200, so they come next and are the path for every other
# GPU. flash_attn (FA2) was not installed there and was not measured. Head dims above 256 skip triton (not tuned or
# tested); FlashAttention-4 is skipped for head dims it does not take or whose gradients were not verified.
PREFERENCE = {"cuda": ("flash_attn_4", "triton", "flash_attn", "torch", "sdpa"), "cpu": ("sdpa", "triton")}
TRITON_MAX_HEAD_DIM = 256
# Backends whose forward and backward are `torch.library` ops: a compiled decoder layer calls them inside its graph.
IN_GRAPH = ("flash_attn_4", "triton")


def available_backends(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> list[str]:
    """Names of the backends that can run on `device` with `dtype`, in preference order."""
    device = torch.device(device)
    order = PREFERENCE.get(device.type, PREFERENCE["cpu"])
    return [name for name in order if BACKENDS[name](device, dtype) is None]


def _candidates(
    device: torch.device, head_dim: int | None, capability: tuple[int, int] | None = None
) -> tuple[dict[str, dispatch.Availability], tuple[str, ...]]:
    """The backends and their order for `device` and `head_dim` (`capability`: the GPU's, known without asking)."""
    order = PREFERENCE.get(device.type, PREFERENCE["cpu"])
    if head_dim is not None and head_dim > TRITON_MAX_HEAD_DIM:
        order = tuple(name for name in order if name != "triton")
    backends = BACKENDS
    if head_dim is not None or capability is not None:  # FlashAttention-4 only at the head dims it takes
        from sftflow.kernels.attention_fa4 import head_dim_reason, unavailable_reason

        def fa4_at_this_head_dim(device: torch.device, dtype: torch.dtype) -> str | None:
            if capability is None:
                why_not = BACKENDS["flash_attn_4"](device, dtype)
            else:
                why_not = unavailable_reason(device, dtype, capability)
            if why_not is None and head_dim is not None:
                return head_dim_reason(head_dim, device, capability)
            return why_not

        backends = {**BACKENDS, "flash_attn_4": fa4_at_this_head_dim}
    return backends, order


def select_backend(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, head_dim: int | None = None
) -> dispatch.BackendChoice:
    """The backend `varlen_attention` runs for tensors on `device` with `dtype`, and why (logged once)."""
    device = torch.device(device)
    backends, order = _candidates(device, head_dim)
    return dispatch.select(KERNEL, ENV_VAR, backends, order, device, dtype)


def preview_backend(
    device: torch.device | str, dtype: torch.dtype, head_dim: int | None, capability: tuple[int, int] | None = None
) -> dispatch.BackendChoice:
    """`select_backend`'s choice for a run that has not started: neither logged nor recorded, and on a GPU of
    `capability` without asking the device."""
    device = torch.device(device)
    backends, order = _candidates(device, head_dim, capability)
    return dispatch.choose(KERNEL, ENV_VAR, backends, order, device, dtype)


def last_backend() -> dispatch.BackendChoice | None:
    """The backend the last dispatched call ran with (name and reason), or None before the first call."""
    return dispatch.last_choice(KERNEL)


def _expand_kv(k_TKD: torch.Tensor, group: int) -> torch.Tensor:
    return k_TKD if group == 1 else k_TKD.repeat_interleave(group, dim=1)


def document_causal_mask(
    cu_seqlens: torch.Tensor, total: int, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """(T, T) bool: True where query i may attend key j (same document, j <= i, and i - j < window if given)."""
    pos = torch.arange(total, device=device)
    doc = torch.searchsorted(cu_seqlens[1:].to(device=device, dtype=torch.long), pos, right=True)
    mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    return mask


def _attention_sdpa(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale, window):
    """Each document through SDPA's causal path on its own: work O(sum of L^2) and no padding. Padding the documents
    to the longest made the copies into and out of the padded batch (each document's backward re-copies the whole
    padded gradient) cost as much as the attention itself on a CPU, and half of the padded work was on pads; one
    (T, T) block-diagonal mask costs O(T^2). A document is a view of the row (`split`), and the row is one `cat` of the
    outputs, so the only copies are one per direction. The lengths come to the host: this is the reference."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    gqa = q_THD.shape[1] != k_TKD.shape[1]
    visible = None
    if window is not None:
        pos = torch.arange(max(lengths), device=q_THD.device)
        visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    outs = []
    for q, k, v in zip(*(torch.split(x, lengths) for x in (q_THD, k_TKD, v_TKD)), strict=True):
        n = q.shape[0]
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (heads, n, D)
        if visible is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:n, :n], scale=scale, enable_gqa=gqa)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def _attention_torch(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale, window):
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kwargs = {"scale": scale}
    if "window_size" in params:  # torch >= 2.11: (left, right) = (-1, 0) is causal, (W - 1, 0) a window of W keys
        kwargs["window_size"] = (-1 if window is None else window - 1, 0)
    elif window is not None:
        raise ValueError(f"attention backend 'torch': torch {torch.__version__} varlen_attn has no window_size")
    else:  # torch 2.10
        kwargs["is_causal"] = True
    group = q_THD.shape[1] // k_TKD.shape[1]
    if group > 1 and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    else:
        k_TKD, v_TKD = _expand_kv(k_TKD, group), _expand_kv(v_TKD, group)
    cu = cu_seqlens.to(torch.int32)
    return varlen_attn(q_THD, k_TKD, v_TKD, cu, cu, max_seqlen, max_seqlen, **kwargs)


def _attention_flash_attn(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale, window):
    from flash_attn import flash_attn_varlen_func

    cu = cu_seqlens.to(torch.int32)
    window_size = (-1, -1) if window is None else (window - 1, 0)
    return flash_attn_varlen_func(
        q_THD, k_TKD, v_TKD, cu, cu, max_seqlen, max_seqlen, softmax_scale=scale, causal=True, window_size=window_size
    )


def _attention_flash_attn_4(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale, window):
    from sftflow.kernels.attention_fa4 import fa4_varlen_attention

    return fa4_varlen_attention(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale, window)


def _attention_triton(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale, window):
    from sftflow.kernels.attention_triton import triton_varlen_attention

    return triton_varlen_attention(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale, window)


IMPLEMENTATIONS = {
    "flash_attn_4": _attention_flash_attn_4,
    "flash_attn": _attention_flash_attn,
    "triton": _attention_triton,
    "torch": _attention_torch,
    "sdpa": _attention_sdpa,
}


def varlen_attention(
    q_THD: torch.Tensor,
    k_TKD: torch.Tensor,
    v_TKD: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
    window: int | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal attention within each document of a packed row; returns (T, H, D) like `q_THD`. Differentiable.

    `cu_seqlens` is the (N + 1,) int tensor of document boundaries, starting at 0 and ending at T; `max_seqlen`
    the longest document. `scale` defaults to 1 / sqrt(D). `window` (sliding-window attention, Hugging Face's
    `sliding_window`): query i sees keys j with i - window < j <= i only. `backend` overrides the dispatch and
    SFTFLOW_ATTENTION.
    """
    if q_THD.ndim != 3 or k_TKD.ndim != 3 or k_TKD.shape != v_TKD.shape:
        raise ValueError(
            f"expected q (T, H, D), k and v (T, K, D); got {tuple(q_THD.shape)}, "
            f"{tuple(k_TKD.shape)}, {tuple(v_TKD.shape)}"
        )
    T, H, D = q_THD.shape
    if k_TKD.shape[0] != T or k_TKD.shape[2] != D or H % k_TKD.shape[1] != 0:
        raise ValueError(
            f"k/v shape {tuple(k_TKD.shape)} does not fit q {tuple(q_THD.shape)}: "
            "need the same T and D, and H a multiple of K"
        )
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [0, ..., T] with at least 2 entries, got {cu_seqlens}")
    if cu_seqlens.device.type == "cpu" and int(cu_seqlens[-1]) != T:
        raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])} but q has T={T} tokens")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if window is not None and window < 1:
        raise ValueError(f"window={window}: a query must see at least itself")
    if backend is None:
        backend = select_backend(q_THD.device, q_THD.dtype, D).name
    elif backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not an {KERNEL} backend; expected one of {sorted(BACKENDS)}")
    return IMPLEMENTATIONS[backend](q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale, window)
