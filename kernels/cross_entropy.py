"""Fused linear + masked cross-entropy: the LM head and the loss in one pass, without (T, V) logits.

``linear_cross_entropy(hidden_TD, weight_VD, labels_T)`` returns the *sum* of the token losses over the trained
tokens (labels != ignore_index); the caller divides by the global trained-token count. It works like this::

    rows   = nonzero(labels != -100)                 compact: masked tokens cost no matmul
    for each chunk of C trained rows:                peak extra memory ~ C x V logits (+ the two gradients);
                                                     the last chunk padded to a multiple of 64 rows (fixed shapes)
        logits_CV  = hidden[rows_C] @ weight^T       cuBLAS, fp32 accumulation, stored in the input dtype
        loss_C     = lse(logits) - logits[target]    one kernel reads the logits and overwrites them, in place,
        logits_CV <- softmax(logits) - onehot        with d loss / d logits (fp32 math)
        grad_hidden[rows_C]  = logits_CV @ weight
        grad_weight         += logits_CV^T @ hidden[rows_C]

The gradients are computed in the forward and kept for the backward, which only scales them by the incoming
gradient (an autograd.Function; the Triton backend skips that pass when the gradient is 1, checked on the device).
The per-chunk softmax step is either plain PyTorch (``reference``, the CPU default and the oracle's twin) or a
Triton kernel (``triton``, the CUDA default; it also runs on CPU under ``TRITON_INTERPRET=1``).
``SFTFLOW_CROSS_ENTROPY=<name>`` forces a backend.

Precision: every matmul accumulates in fp32 and the softmax math is fp32. ``grad_weight`` is accumulated across
chunks in the input dtype (as Liger-Kernel does): an fp32 (V, D) buffer would cost 1 GiB more at V=128k, D=2048.
The returned loss is an fp32 scalar (fp64 for fp64 inputs).
"""

from __future__ import annotations

import torch

from sftflow.kernels import dispatch

KERNEL = "cross_entropy"
ENV_VAR = "SFTFLOW_CROSS_ENTROPY"
# One chunk's working rows take at most this many bytes: 128 MiB is 512 rows of logits at V=128256 in bf16, as
# Liger's heuristic, so that our peak memory is never above Liger's.
CHUNK_LOGITS_BYTES = 1 << 27
# The last chunk of trained rows is padded to a multiple of this many rows, so its matmuls repeat shapes
# (`padded_rows`).
ROW_BUCKET = 64


BACKENDS = dispatch.TRITON_OR_REFERENCE
PREFERENCE = dispatch.TRITON_ON_CUDA


def available_backends(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> list[str]:
    """Names of the backends that can run on `device` with `dtype`, in preference order."""
    device = torch.device(device)
    order = PREFERENCE.get(device.type, PREFERENCE["cpu"])
    return [name for name in order if BACKENDS[name](device, dtype) is None]


def select_backend(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> dispatch.BackendChoice:
    """The backend `linear_cross_entropy` runs for tensors on `device` with `dtype`, and why (logged once)."""
    device = torch.device(device)
    order = PREFERENCE.get(device.type, PREFERENCE["cpu"])
    return dispatch.select(KERNEL, ENV_VAR, BACKENDS, order, device, dtype)


def preview_backend(device: torch.device | str, dtype: torch.dtype) -> dispatch.BackendChoice:
    """`select_backend`'s choice for a run that has not started, neither logged nor recorded."""
    device = torch.device(device)
    order = PREFERENCE.get(device.type, PREFERENCE["cpu"])
    return dispatch.choose(KERNEL, ENV_VAR, BACKENDS, order, device, dtype)


def last_backend() -> dispatch.BackendChoice | None:
    """The backend the last dispatched call ran with (name and reason), or None before the first call."""
    return dispatch.last_choice(KERNEL)


def _ce_step_reference(
    logits_CV: torch.Tensor, target_C: torch.Tensor, loss_C: torch.Tensor, correct_C: torch.Tensor | None = None
) -> None:
    """Writes each row's CE into `loss_C` (fp32 math) and, with `correct_C`, 1 where the target's logit is the row's
    largest (0 elsewhere); overwrites `logits_CV` with softmax - onehot."""
    # fp32 math (fp64 for fp64 inputs); the same tensor when no cast is needed: fine, it is overwritten anyway
    x = logits_CV.to(torch.promote_types(logits_CV.dtype, torch.float32))
    lse = torch.logsumexp(x, dim=1)
    x_target = x.gather(1, target_C[:, None]).squeeze(1)
    if correct_C is not None:
        correct_C.copy_(x_target >= x.amax(dim=1))
    torch.sub(lse, x_target, out=loss_C)
    x = torch.exp(x - lse[:, None])
    x[torch.arange(x.shape[0], device=x.device), target_C] -= 1.0
    logits_CV.copy_(x)


def _ce_step_triton(
    logits_CV: torch.Tensor, target_C: torch.Tensor, loss_C: torch.Tensor, correct_C: torch.Tensor | None = None
) -> None:
    from sftflow.kernels.cross_entropy_triton import ce_loss_and_grad_

    ce_loss_and_grad_(logits_CV, target_C, loss_C, correct_C)


def _scale_reference(x: torch.Tensor, s: torch.Tensor) -> None:
    x.mul_(s.to(x.dtype))


def _scale_triton(x: torch.Tensor, s: torch.Tensor) -> None:
    from sftflow.kernels.cross_entropy_triton import scale_

    if not x.is_contiguous():  # grad_weight follows the weight's strides
        _scale_reference(x, s)
        return
    scale_(x, s.detach().float().contiguous())


CE_STEPS = {"reference": _ce_step_reference, "triton": _ce_step_triton}
SCALES = {"reference": _scale_reference, "triton": _scale_triton}


def default_chunk_rows(vocab_size: int, dtype: torch.dtype, hidden_size: int = 0, gathered: bool = False) -> int:
    """Rows per chunk so that one chunk's working rows take at most CHUNK_LOGITS_BYTES (a multiple of 16 when > 64).

    A chunk holds its logits (V per row); when only some tokens train (`gathered`), also the gathered hidden rows and
    the `grad_hidden` rows before their scatter (2 x D per row). Counting those keeps the masked peak at or under
    the all-trained one (at V=128256, D=2048: 496 rows instead of 512).
    """
    per_row = max(vocab_size, 1) + (2 * hidden_size if gathered else 0)
    rows = max(1, CHUNK_LOGITS_BYTES // (per_row * torch.empty((), dtype=dtype).element_size()))
    return rows if rows < 64 else rows // 16 * 16


def padded_rows(n: int, chunk_rows: int) -> int:
    """Trained rows `n` with the last chunk rounded up to a multiple of ROW_BUCKET rows (at most a full chunk).

    Why: the number of trained tokens differs from step to step, so an unpadded last chunk gives its three matmuls a
    new shape nearly every step. On an H200 each new cuBLAS shape cost ~2.5 ms of host time (the heuristic), and
    the first use of a newly chosen kernel sometimes stalled the host until the GPU had drained its queue (~40 ms
    of lead lost): the GPU then idled while the host caught up. Padded, the last chunk takes one of
    chunk_rows / ROW_BUCKET shapes, all seen within the first steps; it costs at most ROW_BUCKET - 1 rows of work."""
    last = n % chunk_rows
    if last == 0:
        return n
    return n - last + min(chunk_rows, -(-last // ROW_BUCKET) * ROW_BUCKET)


def _loss_and_grads(
    hidden_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_T: torch.Tensor,
    ignore_index: int,
    chunk_rows: int | None,
    ce_step,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    rows: torch.Tensor | None = None,
    row_stats: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    V = weight_VD.shape[0]
    loss_dtype = torch.promote_types(hidden_TD.dtype, torch.float32)
    grad_hidden = torch.zeros_like(hidden_TD, memory_format=torch.contiguous_format) if need_grad_hidden else None
    checked = rows is not None  # the caller found the rows (and checked their labels) on the host
    if rows is None:
        rows = (labels_T != ignore_index).nonzero().squeeze(1)  # a host sync: nonzero's size lives on the device
    if rows.numel() == 0:
        return (
            torch.zeros((), dtype=loss_dtype, device=hidden_TD.device),
            grad_hidden,
            torch.zeros_like(weight_VD) if need_grad_weight else None,
            torch.zeros((2, 0), dtype=loss_dtype, device=hidden_TD.device) if row_stats else None,
        )
    # The first chunk's matmul writes grad_weight (no zero fill, no read of zeros): 1 GB less traffic at V=128k.
    grad_weight = torch.empty_like(weight_VD) if need_grad_weight else None
    targets = labels_T.index_select(0, rows)
    if not checked and bool(((targets < 0) | (targets >= V)).any()):
        bad = targets[(targets < 0) | (targets >= V)][0].item()
        raise ValueError(f"labels: value {bad} is outside [0, {V}) and is not ignore_index={ignore_index}")
    n = rows.numel()
    all_trained = n == hidden_TD.shape[0]  # then chunks are plain slices: no gather, no scatter
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(V, hidden_TD.dtype, hidden_TD.shape[1], gathered=not all_trained)
    padded = n if all_trained else padded_rows(n, chunk_rows)
    if padded > n:  # pad rows: the first trained row again; their gradient rows are zeroed after the CE step
        rows = torch.cat([rows, rows[:1].expand(padded - n)])
        targets = torch.cat([targets, targets[:1].expand(padded - n)])
    # Each chunk writes its rows' losses here, summed once at the end: no per-chunk reduction kernels.
    loss_rows = torch.empty(padded, dtype=loss_dtype, device=hidden_TD.device)
    correct_rows = torch.empty(padded, dtype=loss_dtype, device=hidden_TD.device) if row_stats else None
    for start in range(0, padded, chunk_rows):
        rows_C = rows[start : start + chunk_rows]
        real = min(chunk_rows, n - start)  # the chunk's trained rows; the rest (last chunk only) are padding
        h_CD = hidden_TD[start : start + chunk_rows] if all_trained else hidden_TD.index_select(0, rows_C)
        logits_CV = h_CD @ weight_VD.T
        chunk = slice(start, start + chunk_rows)
        ce_step(logits_CV, targets[chunk], loss_rows[chunk], None if correct_rows is None else correct_rows[chunk])
        if real < logits_CV.shape[0]:
            logits_CV[real:].zero_()  # padding rows add nothing to grad_weight
        if grad_hidden is not None:
            if all_trained:
                torch.mm(logits_CV, weight_VD, out=grad_hidden[start : start + chunk_rows])
            else:
                grad_hidden.index_copy_(0, rows_C[:real], (logits_CV @ weight_VD)[:real])
        if grad_weight is not None:
            if start == 0:
                torch.mm(logits_CV.T, h_CD, out=grad_weight)
            else:
                grad_weight.addmm_(logits_CV.T, h_CD)
        del logits_CV, h_CD  # free this chunk's logits before the next chunk's matmul allocates its own
    stats = torch.stack([loss_rows[:n], correct_rows[:n]]) if row_stats else None
    return loss_rows[:n].sum(), grad_hidden, grad_weight, stats


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_TD, weight_VD, labels_T, ignore_index, chunk_rows, backend, need_h, need_w, rows, stats):
        loss, grad_hidden, grad_weight, row_stats = _loss_and_grads(
            hidden_TD, weight_VD, labels_T, ignore_index, chunk_rows, CE_STEPS[backend], need_h, need_w, rows, stats
        )
        ctx.grads = (grad_hidden, grad_weight)
        ctx.scale = SCALES[backend]
        if row_stats is None:
            return loss
        ctx.mark_non_differentiable(row_stats)
        return loss, row_stats

    @staticmethod
    def backward(ctx, grad_loss, grad_stats=None):
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = (None, None)  # scaled in place below; a second backward through this graph is not supported
        for grad in (grad_hidden, grad_weight):
            if grad is not None:
                ctx.scale(grad, grad_loss)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def linear_cross_entropy(
    hidden_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_T: torch.Tensor,
    ignore_index: int = -100,
    *,
    chunk_rows: int | None = None,
    backend: str | None = None,
    rows: torch.Tensor | None = None,
    row_stats: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sum over trained tokens of cross_entropy(hidden @ weight^T, labels); an fp32 scalar, differentiable.

    `hidden_TD` is (..., D) and `labels_T` the matching (...) int tensor with `ignore_index` for untrained tokens.
    With no trained token the result is a zero still connected to the graph (its gradients are zeros).
    `backend` overrides the dispatch (and the SFTFLOW_CROSS_ENTROPY variable); `chunk_rows` the chunk size.

    `rows`: the flat indices of the trained tokens (int64, on the device), if the caller has them. Finding them here
    (`nonzero`) and checking their labels are in [0, V) are both host syncs, which stop the host from queueing work
    ahead of the GPU for the rest of the step; a training loop that collates on the host knows both already
    (`sftflow.tasks.train.model.model_batch`). Given `rows`, the labels at them must be valid.

    `row_stats=True` also returns a (2, n) tensor (not differentiable) over the n trained tokens in flat order: each
    token's loss, and 1 where its target's logit is the largest (token accuracy; a tie counts as correct). Both come
    out of the softmax pass that computes the loss anyway, so a caller can break the loss down (by data source, say)
    without a second pass over the logits.
    """
    if hidden_TD.shape[:-1] != labels_T.shape:
        raise ValueError(f"labels shape {tuple(labels_T.shape)} does not match hidden {tuple(hidden_TD.shape)}")
    if weight_VD.ndim != 2 or weight_VD.shape[1] != hidden_TD.shape[-1]:
        raise ValueError(f"weight shape {tuple(weight_VD.shape)} is not (V, {hidden_TD.shape[-1]})")
    if backend is None:
        backend = select_backend(hidden_TD.device, hidden_TD.dtype).name
    elif backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not a {KERNEL} backend; expected one of {sorted(BACKENDS)}")
    if rows is not None and (rows.ndim != 1 or rows.dtype != torch.int64 or rows.device != hidden_TD.device):
        raise ValueError(f"rows must be a 1-D int64 tensor on {hidden_TD.device}, got {rows.dtype} {tuple(rows.shape)}")
    D = hidden_TD.shape[-1]
    grad_on = torch.is_grad_enabled()
    loss = _LinearCrossEntropy.apply(
        hidden_TD.reshape(-1, D),
        weight_VD,
        labels_T.reshape(-1),
        ignore_index,
        chunk_rows,
        backend,
        grad_on and hidden_TD.requires_grad,
        grad_on and weight_VD.requires_grad,
        rows,
        row_stats,
    )
    return loss
