"""linear_cross_entropy against float64 F.cross_entropy on full logits: loss, grad_hidden and grad_weight."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch
import torch.nn.functional as F

from sftflow.kernels import cross_entropy as ce
from sftflow.kernels.cross_entropy import linear_cross_entropy

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
BACKENDS = ["reference", pytest.param("triton", marks=needs_triton)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all()
    denom = ref.norm()
    return (out - ref).norm().item() / denom.item() if denom > 0 else out.norm().item()


def oracle(hidden, weight, labels):
    """float64 loss sum and grads through materialised logits."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    loss = F.cross_entropy(h @ w.T, labels, reduction="sum", ignore_index=-100)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def make_labels(T: int, V: int, mask_fraction: float, generator, device) -> torch.Tensor:
    labels = torch.randint(0, V, (T,), generator=generator)
    masked = torch.randperm(T, generator=generator)[: round(T * mask_fraction)]
    labels[masked] = -100
    return labels.to(device)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T", [1, 17, 257])
@pytest.mark.parametrize("V", [1, 100, 1000])
@pytest.mark.parametrize("mask_fraction", [0.0, 0.5, 1.0])
def test_matches_float64_oracle(backend, T, V, mask_fraction, device):
    g = torch.Generator().manual_seed(T * 1000 + V + int(mask_fraction * 10))
    D = 24
    hidden = torch.randn(T, D, generator=g).to(device).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 0.5).to(device).requires_grad_()
    labels = make_labels(T, V, mask_fraction, g, device)

    loss = linear_cross_entropy(hidden, weight, labels, backend=backend, chunk_rows=64)
    loss.backward()
    ref_loss, ref_gh, ref_gw = oracle(hidden, weight, labels)

    assert loss.dtype == torch.float32
    assert hidden.grad.dtype == hidden.dtype and weight.grad.dtype == weight.dtype
    if (labels != -100).any():
        assert rel_err(loss, ref_loss) <= 1e-5
        assert rel_err(hidden.grad, ref_gh) <= 1e-5
        assert rel_err(weight.grad, ref_gw) <= 1e-5
    else:  # nothing trained: a graph-connected zero with zero gradients
        assert loss.item() == 0.0 and loss.grad_fn is not None
        assert torch.count_nonzero(hidden.grad) == 0 and torch.count_nonzero(weight.grad) == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_fraction", [0.0, 0.5, 1.0])
def test_rows_given_by_the_caller_give_the_same_loss_and_grads(backend, mask_fraction, device):
    """`rows` (the trained positions, found on the host by the training loop) replaces the nonzero sync."""
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(2, 33, 16, generator=g).to(device).requires_grad_()
    weight = torch.randn(50, 16, generator=g).to(device).requires_grad_()
    labels = make_labels(66, 50, mask_fraction, g, device).reshape(2, 33)
    results = []
    for rows in (None, (labels.reshape(-1) != -100).nonzero().squeeze(1)):
        loss = linear_cross_entropy(hidden, weight, labels, backend=backend, chunk_rows=16, rows=rows)
        results.append((loss.detach(), *torch.autograd.grad(loss, (hidden, weight))))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_fraction", [0.0, 0.5, 1.0])
def test_row_stats_are_each_tokens_loss_and_hit_and_change_nothing_else(backend, mask_fraction, device):
    """`row_stats`: per trained token (flat order) the float64 oracle's loss and whether argmax == target; the loss
    and gradients are those of the call without it. Chunks of 16 over 66 rows: several chunks and a padded last."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 33, 16, generator=g).to(device).requires_grad_()
    weight = torch.randn(50, 16, generator=g).to(device).requires_grad_()
    labels = make_labels(66, 50, mask_fraction, g, device).reshape(2, 33)
    # a few targets set to the argmax, so both outcomes of the hit are exercised
    logits = (hidden.detach().double() @ weight.detach().double().T).reshape(66, 50)
    flat = labels.reshape(-1).clone()
    trained = (flat != -100).nonzero().squeeze(1)
    flat[trained[::3]] = logits.argmax(1)[trained[::3]]
    labels = flat.reshape(2, 33)

    loss, stats = linear_cross_entropy(hidden, weight, labels, backend=backend, chunk_rows=16, row_stats=True)
    grads = torch.autograd.grad(loss, (hidden, weight))
    plain = linear_cross_entropy(hidden, weight, labels, backend=backend, chunk_rows=16)
    for a, b in zip((loss, *grads), (plain, *torch.autograd.grad(plain, (hidden, weight))), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    assert stats.shape == (2, trained.numel()) and not stats.requires_grad
    target = flat[trained]
    ref_loss = F.cross_entropy(logits[trained], target, reduction="none")
    torch.testing.assert_close(stats[0].double().cpu(), ref_loss.cpu(), rtol=1e-5, atol=1e-5)
    hits = (logits[trained].argmax(1) == target).double()
    assert torch.equal(stats[1].double().cpu(), hits.cpu())
    if trained.numel():
        assert 0 < hits.sum() < trained.numel()
        torch.testing.assert_close(stats[0].sum(), loss.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tied_weights_and_grad_scaling(backend, device):
    """The LM head is the embedding table: its gradient sums both uses; an upstream scale reaches both grads."""
    g = torch.Generator().manual_seed(7)
    T, V, D = 33, 90, 16
    ids = torch.randint(0, V, (T,), generator=g).to(device)
    table = torch.randn(V, D, generator=g).to(device).requires_grad_()
    labels = make_labels(T, V, 0.3, g, device)

    hidden = torch.tanh(F.embedding(ids, table))
    loss = linear_cross_entropy(hidden, table, labels, backend=backend, chunk_rows=8) / 3.0
    loss.backward()

    table64 = table.detach().double().requires_grad_()
    ref = F.cross_entropy(torch.tanh(F.embedding(ids, table64)) @ table64.T, labels, reduction="sum") / 3.0
    ref.backward()
    assert rel_err(loss, ref) <= 1e-5
    assert rel_err(table.grad, table64.grad) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_dims_and_frozen_weight(backend, device):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 9, 8, generator=g).to(device).requires_grad_()
    weight = torch.randn(50, 8, generator=g).to(device)  # frozen head: no grad asked, none computed
    labels = make_labels(18, 50, 0.5, g, device).view(2, 9)
    loss = linear_cross_entropy(hidden, weight, labels, backend=backend)
    loss.backward()
    ref_loss, ref_gh, _ = oracle(hidden.view(18, 8), weight, labels.view(18))
    assert rel_err(loss, ref_loss) <= 1e-5
    assert rel_err(hidden.grad.view(18, 8), ref_gh) <= 1e-5
    assert weight.grad is None


def test_no_grad_forward_gives_the_loss():
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(20, 8, generator=g), torch.randn(30, 8, generator=g)
    labels = make_labels(20, 30, 0.5, g, "cpu")
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels)
    assert rel_err(loss, oracle(hidden, weight, labels)[0]) <= 1e-5


def test_bad_inputs_are_value_errors():
    hidden, weight = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="outside"):
        linear_cross_entropy(hidden, weight, torch.tensor([1, 10, -100, 2]))
    with pytest.raises(ValueError, match="does not match"):
        linear_cross_entropy(hidden, weight, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="not a cross_entropy backend"):
        linear_cross_entropy(hidden, weight, torch.tensor([1, 2, 3, 4]), backend="cuda-magic")
    with pytest.raises(ValueError, match="rows must be a 1-D int64"):
        linear_cross_entropy(hidden, weight, torch.tensor([1, 2, 3, 4]), rows=torch.tensor([0, 1], dtype=torch.int32))


def test_dispatch_env_override_and_logging(monkeypatch, caplog):
    monkeypatch.setenv("SFTFLOW_CROSS_ENTROPY", "nope")
    with pytest.raises(ValueError, match=r"expected one of \['reference', 'triton'\]"):
        ce.select_backend("cpu")
    monkeypatch.setenv("SFTFLOW_CROSS_ENTROPY", "reference")
    with caplog.at_level(logging.INFO, logger="sftflow.kernels"):
        choice = ce.select_backend("cpu", torch.float32)
        ce.select_backend("cpu", torch.float32)
    assert (choice.name, choice.reason) == ("reference", "forced by SFTFLOW_CROSS_ENTROPY")
    assert sum("cross_entropy backend: reference" in r.getMessage() for r in caplog.records) <= 1
    monkeypatch.delenv("SFTFLOW_CROSS_ENTROPY")
    assert ce.select_backend("cpu").name == "reference"
    assert "reference" in ce.available_backends("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("mask_fraction", [0.0, 0.5])
def test_triton_bf16_on_gpu(mask_fraction):
    g = torch.Generator().manual_seed(11)
    T, D, V = 2048, 512, 32003
    hidden = torch.randn(T, D, generator=g).cuda().bfloat16().requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 0.05).cuda().bfloat16().requires_grad_()
    labels = make_labels(T, V, mask_fraction, g, "cuda")
    loss = linear_cross_entropy(hidden, weight, labels, backend="triton", chunk_rows=256)
    loss.backward()
    ref_loss, ref_gh, ref_gw = oracle(hidden, weight, labels)
    assert rel_err(loss, ref_loss) <= 1e-2
    assert rel_err(hidden.grad, ref_gh) <= 1e-2
    assert rel_err(weight.grad, ref_gw) <= 1e-2


def test_chunk_rows_keep_the_masked_peak_under_the_all_trained_one():
    bf16 = torch.bfloat16
    assert ce.default_chunk_rows(128256, bf16, 2048) == 512  # Liger's chunk at the shape
    masked = ce.default_chunk_rows(128256, bf16, 2048, gathered=True)
    assert masked % 16 == 0 and masked < 512
    assert masked * (128256 + 2 * 2048) * 2 <= ce.CHUNK_LOGITS_BYTES  # logits + gathered rows + grad rows
    assert ce.default_chunk_rows(10**9, torch.float32) == 1


@pytest.mark.parametrize("chunk_rows", [None, 3])
def test_grad_weight_is_written_by_the_first_chunk_not_accumulated_onto_garbage(chunk_rows):
    """grad_weight starts as torch.empty: a stale first chunk would show up as a wrong gradient."""
    torch.manual_seed(0)
    hidden = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 13, (11,))
    labels[::3] = -100
    for _ in range(2):  # the second call reuses freed (non-zero) memory from the caching allocator
        hidden.grad = weight.grad = None
        linear_cross_entropy(hidden, weight, labels, chunk_rows=chunk_rows, backend="reference").backward()
        ref_w = weight.detach().clone().requires_grad_()
        F.cross_entropy(hidden.detach() @ ref_w.T, labels, reduction="sum").backward()
        torch.testing.assert_close(weight.grad, ref_w.grad)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_kernel_scales_in_fp32_and_skips_a_scale_of_one(dtype, device):
    from sftflow.kernels.cross_entropy_triton import SCALE_BLOCK, scale_

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * SCALE_BLOCK + 37, generator=g).to(device, dtype)  # a partial last block
    before = x.clone()
    scale_(x, torch.ones((), device=device))
    assert torch.equal(x, before)  # 1: untouched (no pass)
    s = torch.tensor(1 / 4096.0 + 1e-7, device=device)  # not exact in bf16: fp32 math gives the closer result
    scale_(x, s)
    assert torch.equal(x, (before.float() * s).to(dtype))
    scale_(x, torch.zeros((), device=device))
    assert torch.count_nonzero(x) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_last_chunk_is_padded_to_a_few_shapes_and_padding_changes_nothing(backend, device):
    """The trained-row count varies per step; padded, the last chunk's matmuls take few shapes (so cuBLAS meets each
    shape once, not once per step), and the padding rows change neither the loss nor a gradient."""
    from torch.utils._python_dispatch import TorchDispatchMode

    T, V, D, chunk = 300, 40, 8, 200
    logits_rows = set()

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name == "aten::mm" and tuple(args[1].shape) == (D, V):  # hidden rows @ weight^T
                logits_rows.add(args[0].shape[0])
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(11)
    for n in (1, 63, 64, 65, 130, 199, 200, 201, 263, 299):  # (all T trained: plain slices of hidden)
        hidden = torch.randn(T, D, generator=g).to(device).requires_grad_()
        weight = torch.randn(V, D, generator=g).to(device).requires_grad_()
        labels = torch.full((T,), -100)
        trained = torch.randperm(T, generator=g)[:n]
        labels[trained] = torch.randint(0, V, (n,), generator=g)
        labels = labels.to(device)
        with Shapes():
            loss = linear_cross_entropy(hidden, weight, labels, backend=backend, chunk_rows=chunk)
        loss.backward()
        ref_loss, ref_gh, ref_gw = oracle(hidden, weight, labels)
        assert rel_err(loss, ref_loss) <= 1e-5, n
        assert rel_err(hidden.grad, ref_gh) <= 1e-5, n
        assert rel_err(weight.grad, ref_gw) <= 1e-5, n
        assert torch.count_nonzero(hidden.grad[labels == -100]) == 0, n  # nothing leaks into untrained rows
    assert logits_rows == {64, 128, 192, 200}
    assert [ce.padded_rows(n, 200) for n in (1, 64, 65, 199, 200, 201, 400)] == [64, 64, 128, 200, 200, 264, 400]
