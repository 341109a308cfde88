"""varlen_attention against an fp64 per-document dense reference: forward, backward, isolation and dispatch."""

from __future__ import annotations

import importlib.util
import logging

import numpy as np
import pytest
import torch

from sftflow.kernels import attention as attn
from sftflow.kernels.attention import varlen_attention

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
BACKENDS = ["sdpa", pytest.param("triton", marks=needs_triton)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all()
    denom = ref.norm().item()
    return (out - ref).norm().item() / denom if denom > 0 else out.norm().item()  # e.g. dq of 1-token documents


def dense_reference(q, k, v, doc_lengths, scale, window=None):
    """fp64, one document at a time, with an explicit causal (and sliding-window) mask; GQA by repeating kv heads."""
    q, k, v = (x.detach().double().cpu() for x in (q, k, v))
    return _differentiable_reference(q, k, v, doc_lengths, scale, window)


def make_inputs(doc_lengths, H, K, D, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(doc_lengths)
    q, k, v = (torch.randn(T, n, D, generator=g).to(device, dtype).requires_grad_() for n in (H, K, K))
    cu = torch.tensor([0, *torch.tensor(doc_lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu


CASES = {
    "one_doc": ([45], 4, 4, 16),
    "many_1_token_docs": ([1] * 11, 4, 2, 16),
    "odd_lengths_gqa4": ([5, 37, 1, 20, 3], 8, 2, 32),
    "gqa8": ([19, 14], 8, 1, 16),
    "head_dim_24": ([9, 30], 2, 1, 24),
}


def assert_matches_fp64(o, q, k, v, doc_lengths, scale, tol, window=None):
    """`o` and, after a backward with a random dO, q/k/v's gradients against the fp64 per-document reference."""
    do = torch.randn_like(o)
    o.backward(do)
    q64, k64, v64 = (x.detach().double().cpu().requires_grad_() for x in (q, k, v))
    ref = _differentiable_reference(q64, k64, v64, doc_lengths, scale, window)
    ref.backward(do.double().cpu())
    assert o.shape == q.shape and o.dtype == q.dtype
    assert rel_err(o, ref) <= tol
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert got.dtype == q.dtype and rel_err(got, want) <= tol


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_backward_match_fp64(backend, case, device):
    doc_lengths, H, K, D = CASES[case]
    q, k, v, cu = make_inputs(doc_lengths, H, K, D, device, seed=len(case))
    o = varlen_attention(q, k, v, cu, max(doc_lengths), backend=backend)
    assert_matches_fp64(o, q, k, v, doc_lengths, D**-0.5, tol=1e-5)


def _differentiable_reference(q, k, v, doc_lengths, scale, window=None):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    outs, start = [], 0
    for length in doc_lengths:
        sl = slice(start, start + length)
        scores = torch.einsum("ihd,jhd->hij", q[sl], k[sl]) * scale
        visible = torch.ones(length, length, dtype=torch.bool).tril()
        if window is not None:  # Hugging Face's sliding window: key j visible from query i iff i - window < j <= i
            visible = visible.triu(-(window - 1))
        outs.append(torch.einsum("hij,jhd->ihd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v[sl]))
        start += length
    return torch.cat(outs)


# Windows shorter than some documents, of one token, equal to a document, and longer than the row; with documents
# that start inside a block, so that windows and document starts cut the same blocks.
WINDOW_CASES = {
    "w1": ([5, 9], 4, 2, 16, 1),
    "w4_docs_longer": ([3, 37, 20, 1], 4, 2, 16, 4),
    "w17_gqa4": ([50, 2, 33], 8, 2, 32, 17),
    "w_equals_doc": ([23, 23], 4, 4, 16, 23),
    "w_longer_than_row": ([12, 30], 2, 1, 24, 500),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_sliding_window_forward_and_backward_match_fp64(backend, case, device):
    doc_lengths, H, K, D, window = WINDOW_CASES[case]
    q, k, v, cu = make_inputs(doc_lengths, H, K, D, device, seed=len(case) + window)
    o = varlen_attention(q, k, v, cu, max(doc_lengths), window=window, backend=backend)
    assert_matches_fp64(o, q, k, v, doc_lengths, D**-0.5, tol=1e-5, window=window)


def test_a_window_changes_the_output_only_where_it_cuts():
    """Tokens nearer their document start than the window see the same keys with and without it."""
    doc_lengths, window = [10, 30], 8
    q, k, v, cu = make_inputs(doc_lengths, 4, 2, 16, "cpu", seed=3)
    with torch.no_grad():
        full = varlen_attention(q, k, v, cu, 30, backend="sdpa")
        windowed = varlen_attention(q, k, v, cu, 30, window=window, backend="sdpa")
    first_in_doc = torch.tensor([i for i in range(10)] + [i for i in range(30)])
    inside = first_in_doc < window
    assert torch.equal(full[inside], windowed[inside])
    assert not torch.allclose(full[~inside], windowed[~inside])


# Tile shapes as the GPU uses them (BLOCK_M != BLOCK_N both ways), both program orders, and a head dim that is not a
# power of two. Documents of 70 and 100 tokens give each kernel masked blocks at a document start, unmasked blocks
# inside it, and masked blocks on the diagonal and the end.
# "split" runs dV and dK as two passes of the key-block kernel.
# "pack" stacks a GQA group's query heads as the rows of one query tile (forward and dQ programs, dK/dV query tiles);
# "tma" moves every tile through tensor descriptors (the interpreter emulates them).
def _tiles(fwd_m, fwd_n, kv_m, kv_n, order, split=False, pack=False, tma=False):
    fwd = {
        "BLOCK_M": fwd_m,
        "BLOCK_N": fwd_n,
        "ORDER": order,
        "num_warps": 4,
        "num_stages": 1,
        "PACK": pack,
        "TMA": tma,
    }
    dkdv = {**fwd, "BLOCK_M": kv_m, "BLOCK_N": kv_n, "SPLIT": split}
    return {"fwd": fwd, "dkdv": dkdv, "dq": fwd}


TILES = {
    "m32_n16_lpt": _tiles(32, 16, 16, 32, "lpt"),
    "m32_n16_row": _tiles(32, 16, 16, 32, "row"),
    "m16_n32_lpt": _tiles(16, 32, 32, 16, "lpt"),
    "m16_n32_row": _tiles(16, 32, 32, 16, "row"),
    "m32_n16_lpt_split": _tiles(32, 16, 16, 32, "lpt", split=True),
    "m32_n16_lpt_pack": _tiles(32, 16, 16, 32, "lpt", pack=True),
    "m16_n32_row_pack": _tiles(16, 32, 32, 16, "row", pack=True),
    "m32_n16_lpt_split_pack": _tiles(32, 16, 16, 32, "lpt", split=True, pack=True),
    "m32_n16_lpt_tma": _tiles(32, 16, 16, 32, "lpt", tma=True),
    "m16_n32_row_split_tma": _tiles(16, 32, 32, 16, "row", split=True, tma=True),
}
PACKED = ["m32_n16_lpt_pack", "m16_n32_row_pack", "m32_n16_lpt_split_pack"]
TMA = ["m32_n16_lpt_tma", "m16_n32_row_split_tma"]


def _tile_cases():
    # packed programs at groups of 4 and 2, and of 3 (which divides no tile: one program per head, as unpacked);
    # TMA at head dims 16 and 32, and 24 (no descriptor: not a power of two, so pointers)
    for tiles in TILES:
        shapes = [(4, 4, 16), (4, 1, 24)]
        if tiles in PACKED:
            shapes = [(4, 1, 24), (4, 2, 16), (6, 2, 16)]
        elif tiles in TMA:
            shapes = [(4, 4, 16), (4, 2, 32), (4, 1, 24)]
        yield from (pytest.param(tiles, *shape, id=f"{tiles}-{shape}") for shape in shapes)


@needs_triton
@pytest.mark.parametrize(("tiles", "H", "K", "D"), list(_tile_cases()))
def test_triton_tile_shapes_and_program_orders(tiles, H, K, D, device):
    from sftflow.kernels.attention_triton import triton_varlen_attention

    doc_lengths = [3, 70, 1, 100, 17]
    q, k, v, cu = make_inputs(doc_lengths, H, K, D, device, seed=D)
    o = triton_varlen_attention(q, k, v, cu, max(doc_lengths), D**-0.5, config=TILES[tiles])
    assert_matches_fp64(o, q, k, v, doc_lengths, D**-0.5, tol=1e-5)


@needs_triton
@pytest.mark.parametrize("case", ["w4_docs_longer", "w17_gqa4"])
def test_packed_gqa_tiles_with_sliding_windows(case, device):
    """Windows cut the packed tiles' key ranges per position, as they cut the per-head tiles'."""
    from sftflow.kernels.attention_triton import triton_varlen_attention

    doc_lengths, H, K, D, window = WINDOW_CASES[case]
    q, k, v, cu = make_inputs(doc_lengths, H, K, D, device, seed=len(case) + window)
    o = triton_varlen_attention(q, k, v, cu, max(doc_lengths), D**-0.5, window, config=TILES["m32_n16_lpt_pack"])
    assert_matches_fp64(o, q, k, v, doc_lengths, D**-0.5, tol=1e-5, window=window)


@pytest.mark.parametrize("backend", BACKENDS)
def test_documents_are_isolated(backend, device):
    """Changing every token of document A changes A's outputs and nothing of B or C, before or after it."""
    doc_lengths = [13, 20, 7]
    q, k, v, cu = make_inputs(doc_lengths, 4, 2, 16, device, seed=1)
    with torch.no_grad():
        before = varlen_attention(q, k, v, cu, 20, backend=backend)
        a = slice(13, 33)
        for x in (q, k, v):
            x[a] = torch.randn_like(x[a])
        after = varlen_attention(q, k, v, cu, 20, backend=backend)
    assert not torch.equal(before[a], after[a])
    assert torch.equal(before[:13], after[:13]) and torch.equal(before[33:], after[33:])


def test_dense_reference_agrees_with_sdpa_backend():
    q, k, v, cu = make_inputs([6, 1, 9], 4, 1, 16, "cpu", dtype=torch.float64, seed=2)
    ref = dense_reference(q, k, v, [6, 1, 9], 0.3)
    assert rel_err(varlen_attention(q, k, v, cu, 9, scale=0.3, backend="sdpa"), ref) <= 1e-12


def test_bad_inputs_are_value_errors():
    q, k, v, cu = make_inputs([4, 4], 4, 3, 16, "cpu")
    with pytest.raises(ValueError, match="multiple of K"):
        varlen_attention(q, k, v, cu, 4)
    q, k, v, cu = make_inputs([4, 4], 4, 2, 16, "cpu")
    with pytest.raises(ValueError, match="ends at"):
        varlen_attention(q, k, v, torch.tensor([0, 4, 7]), 4)
    with pytest.raises(ValueError, match="not an attention backend"):
        varlen_attention(q, k, v, cu, 4, backend="magic")


def test_dispatch_env_override_and_logging(monkeypatch, caplog):
    monkeypatch.setenv("SFTFLOW_ATTENTION", "flashy")
    expected = r"expected one of \['flash_attn', 'flash_attn_4', 'sdpa', 'torch', 'triton'\]"
    with pytest.raises(ValueError, match=expected):
        attn.select_backend("cpu")
    monkeypatch.setenv("SFTFLOW_ATTENTION", "torch")
    with pytest.raises(ValueError, match="cannot run on cpu"):
        attn.select_backend("cpu")
    monkeypatch.setenv("SFTFLOW_ATTENTION", "sdpa")
    with caplog.at_level(logging.INFO, logger="sftflow.kernels"):
        choice = attn.select_backend("cpu", torch.float32)
    assert (choice.name, choice.reason) == ("sdpa", "forced by SFTFLOW_ATTENTION")
    monkeypatch.delenv("SFTFLOW_ATTENTION")
    assert attn.select_backend("cpu").name == "sdpa"
    assert attn.available_backends("cpu")[0] == "sdpa"


@needs_triton
def test_cuda_preference_without_a_gpu(monkeypatch):
    """Choosing only inspects availability, so the CUDA order can be checked on CPU: without FlashAttention-4, ours
    first up to D=256, none past it."""
    monkeypatch.delenv("SFTFLOW_ATTENTION", raising=False)
    monkeypatch.setitem(attn.BACKENDS, "flash_attn_4", lambda device, dtype: "flash-attn-4 is not installed")
    assert attn.select_backend("cuda", torch.bfloat16, head_dim=128).name == "triton"
    assert attn.select_backend("cuda", torch.bfloat16, head_dim=256).name == "triton"
    assert attn.select_backend("cuda", torch.bfloat16, head_dim=512).name != "triton"
    q, k, v, cu = make_inputs([3, 5], 2, 1, 16, "cpu")
    varlen_attention(q, k, v, cu, 5)
    assert attn.last_backend().name == "sdpa"


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", [None, 300])
def test_triton_bf16_on_gpu(D, group, window):
    doc_lengths = [700, 1, 129, 64, 2000, 37]
    H = 8
    q, k, v, cu = make_inputs(doc_lengths, H, H // group, D, "cuda", dtype=torch.bfloat16, seed=D + group)
    o = varlen_attention(q, k, v, cu, max(doc_lengths), window=window, backend="triton")
    assert_matches_fp64(o, q, k, v, doc_lengths, D**-0.5, tol=1e-2, window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", [None, 300])
def test_triton_long_document_tiles_bf16_on_gpu(D, group, window):
    """The deeper tiles used for rows of long documents, forced onto a short row so that the fp64 reference stays
    small: the same kernels with other block shapes, masks and program orders."""
    from sftflow.kernels.attention_triton import CONFIGS_LONG, triton_varlen_attention

    doc_lengths = [700, 1, 129, 64, 2000, 37]
    H = 8
    q, k, v, cu = make_inputs(doc_lengths, H, H // group, D, "cuda", dtype=torch.bfloat16, seed=D + group)
    config = CONFIGS_LONG[(D, group > 1)]
    o = triton_varlen_attention(q, k, v, cu, max(doc_lengths), D**-0.5, window, config=config)
    assert_matches_fp64(o, q, k, v, doc_lengths, D**-0.5, tol=1e-2, window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("group", [2, 4, 8])
@pytest.mark.parametrize("window", [None, 300])
def test_triton_packed_gqa_programs_bf16_on_gpu(D, group, window):
    """A GQA group's query heads packed as the rows of each query tile, on the GPU's tiles."""
    from sftflow.kernels.attention_triton import triton_varlen_attention

    doc_lengths = [700, 1, 129, 64, 2000, 37]
    H = 8
    q, k, v, cu = make_inputs(doc_lengths, H, H // group, D, "cuda", dtype=torch.bfloat16, seed=D + group)
    for rows in (64, 128) if D <= 128 else (64,):
        config = {part: {"PACK": True, "BLOCK_M": rows} for part in ("fwd", "dq")}
        config["dkdv"] = {"PACK": True}
        o = triton_varlen_attention(q, k, v, cu, max(doc_lengths), D**-0.5, window, config=config)
        assert_matches_fp64(o, q, k, v, doc_lengths, D**-0.5, tol=1e-2, window=window)
        q.grad = k.grad = v.grad = None


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("long_tiles", [False, True])
def test_triton_pointer_tiles_bf16_on_gpu(D, group, window, long_tiles):
    """Every tile through per-thread pointers and masks instead of the shipped TMA descriptors (the path of tensors
    that descriptors cannot cover, and of GPUs before Hopper), on the packed-row and the long-document tiles."""
    from sftflow.kernels.attention_triton import CONFIGS, CONFIGS_LONG, triton_varlen_attention, with_flags

    doc_lengths = [700, 1, 129, 64, 2000, 37]
    H = 8
    q, k, v, cu = make_inputs(doc_lengths, H, H // group, D, "cuda", dtype=torch.bfloat16, seed=D + group)
    base = (CONFIGS_LONG if long_tiles else CONFIGS)[(D, group > 1)]
    config = with_flags(base, TMA=False)
    o = triton_varlen_attention(q, k, v, cu, max(doc_lengths), D**-0.5, window, config=config)
    assert_matches_fp64(o, q, k, v, doc_lengths, D**-0.5, tol=1e-2, window=window)


@needs_triton
def test_tma_falls_back_to_pointers_where_triton_has_no_descriptors(monkeypatch):
    """The shipped configs ask for TMA; a Triton without host-side descriptors gets the pointer path, not an error."""
    import sys

    from sftflow.kernels import attention_triton

    cpu = torch.device("cpu")
    attention_triton.tma_supported.cache_clear()
    monkeypatch.setitem(sys.modules, "triton.tools.tensor_descriptor", None)  # import raises ImportError
    try:
        assert not attention_triton.tma_supported(cpu)
        cfg, t = {"TMA": True}, torch.zeros(8, 2, 16)
        args = attention_triton._with_tma(cfg, {"q": (t, 16)})
        assert cfg["TMA"] is False and args["q"] is t
    finally:
        attention_triton.tma_supported.cache_clear()
    monkeypatch.undo()
    assert attention_triton.tma_supported(cpu)  # the interpreter emulates descriptors


@needs_triton
def test_rows_of_long_documents_get_the_deeper_tiles():
    """The longest document picks the table: from LONG_DOC tokens on, the long-document shapes."""
    from sftflow.kernels.attention_triton import CONFIGS, CONFIGS_LONG, LONG_DOC, resolve_config

    cuda = torch.device("cuda")
    assert resolve_config(128, True, cuda, max_seqlen=LONG_DOC - 1) == CONFIGS[(128, True)]
    assert resolve_config(128, True, cuda, max_seqlen=LONG_DOC) == CONFIGS_LONG[(128, True)]
    assert (
        resolve_config(64, False, cuda, max_seqlen=65536)["fwd"]["BLOCK_M"]
        == CONFIGS_LONG[(64, False)]["fwd"]["BLOCK_M"]
    )
    assert CONFIGS_LONG[(128, True)] != CONFIGS[(128, True)]


@needs_triton
def test_row_layout_orders_blocks_heaviest_first_and_is_reused():
    from sftflow.kernels.attention_triton import row_layout

    lengths = [5, 40, 3, 20]
    cu = torch.tensor([0, 5, 45, 48, 68], dtype=torch.int32)
    T = 68
    layout = row_layout(cu, T)
    start = torch.repeat_interleave(cu[:-1], torch.tensor(lengths))
    end = torch.repeat_interleave(cu[1:], torch.tensor(lengths))
    assert torch.equal(layout.seq_start, start.int()) and torch.equal(layout.seq_end, end.int())
    assert layout.order("k", 8, "row").tolist() == list(range(9))
    for side, block in (("q", 16), ("k", 8)):
        order = layout.order(side, block).tolist()
        assert sorted(order) == list(range(-(-T // block)))  # every block exactly once
        firsts = [b * block for b in order]
        lasts = [min(f + block, T) - 1 for f in firsts]
        work = [
            last + 1 - int(start[f]) if side == "q" else int(end[last]) - f
            for f, last in zip(firsts, lasts, strict=True)
        ]
        assert work == sorted(work, reverse=True) and work[0] > work[-1]
    assert row_layout(cu, T) is layout  # the same tensor again (every layer of a step): reused
    cu[1] = 6  # changed in place: recomputed
    assert row_layout(cu, T) is not layout
    assert row_layout(cu.clone(), T) is not row_layout(cu, T)


@needs_triton
def test_config_overrides_are_checked():
    from sftflow.kernels.attention_triton import resolve_config, triton_varlen_attention

    cfg = resolve_config(128, True, torch.device("cuda"), {"dq": {"BLOCK_M": 128}})
    with pytest.raises(ValueError, match="at least itself"):
        varlen_attention(*make_inputs([4, 4], 2, 1, 16, "cpu"), 4, window=0)
    assert cfg["dq"]["BLOCK_M"] == 128 and cfg["dq"]["BLOCK_N"] == 32 and cfg["fwd"]["ORDER"] == "lpt"
    with pytest.raises(ValueError, match="unknown"):
        resolve_config(64, False, torch.device("cpu"), {"bwd": {}})
    q, k, v, cu = make_inputs([4, 4], 2, 1, 16, "cpu")
    with pytest.raises(ValueError, match="ORDER="):
        triton_varlen_attention(q, k, v, cu, 4, 0.25, config={"fwd": {"ORDER": "random"}})


def test_flash_attn_adapter_follows_its_varlen_api(monkeypatch):
    """flash-attn is installed on no machine here, so its backend never runs; this checks our side of its documented
    call, `flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=, causal=, window_size=)`,
    against a stand-in module that answers with the sdpa reference."""
    import sys
    import types

    seen = {}

    def flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1)
    ):
        seen.update(q=q, k=k, cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k, scale=softmax_scale, causal=causal)
        seen["window_size"] = window_size
        window = None if window_size[0] < 0 else window_size[0] + 1  # flash-attn counts the keys left of the query
        return varlen_attention(q, k, v, cu_q.long(), max_q, scale=softmax_scale, window=window, backend="sdpa")

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func))
    q, k, v, cu = make_inputs([6, 1, 9], 8, 2, 16, "cpu", seed=4)
    out = varlen_attention(q, k, v, cu.long(), 9, scale=0.3, backend="flash_attn")
    assert seen["q"] is q and seen["k"] is k  # GQA passed through: flash-attn takes K < H itself
    assert seen["cu_q"].dtype == torch.int32 and torch.equal(seen["cu_q"], seen["cu_k"])
    assert (seen["max_q"], seen["max_k"], seen["scale"], seen["causal"]) == (9, 9, 0.3, True)
    assert rel_err(out, dense_reference(q, k, v, [6, 1, 9], 0.3)) <= 1e-6
    out = varlen_attention(q, k, v, cu.long(), 9, scale=0.3, window=4, backend="flash_attn")
    assert seen["window_size"] == (3, 0)
    assert rel_err(out, dense_reference(q, k, v, [6, 1, 9], 0.3, window=4)) <= 1e-6


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_attention_op_passes_opcheck_and_compiles_without_a_graph_break(device):
    """`sftflow::varlen_attention`: schema, fake and autograd registrations (opcheck), and a compiled function
    calling it in one graph (fullgraph) with the eager gradients."""
    from sftflow.kernels.attention_triton import varlen_attention_op

    g = torch.Generator().manual_seed(0)
    T, H, K, D = 40, 4, 2, 16
    q, k, v = (torch.randn(T, n, D, generator=g).to(device).requires_grad_() for n in (H, K, K))
    cu = torch.tensor([0, 13, 14, T], dtype=torch.int32, device=device)
    torch.library.opcheck(varlen_attention_op, (q, k, v, cu, 26, 0.25, 9))

    def attend(q, k, v):
        return varlen_attention_op(q, k, v, cu, 26, 0.25, 9)[0]

    expected = varlen_attention(q, k, v, cu, 26, 0.25, window=9, backend="sdpa")
    want = torch.autograd.grad(expected.square().sum(), (q, k, v))
    torch._dynamo.reset()
    try:
        out = torch.compile(attend, fullgraph=True, dynamic=True, backend="aot_eager")(q, k, v)
        got = torch.autograd.grad(out.square().sum(), (q, k, v))
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_compiled_layers_hold_the_triton_attention_in_their_graph(monkeypatch, device):
    """On the Triton backend a compiled decoder layer is one graph (no break at the attention), with the eager
    layer's loss and gradients; other backends keep the break (`attention_in_graph`)."""
    from torch._dynamo.utils import counters
    from transformers import AttentionInterface
    from transformers.models.llama import modeling_llama

    from sftflow.tasks.train.collate import collate, packed_collator
    from sftflow.tasks.train.compile import attention_in_graph, compile_layers
    from sftflow.tasks.train.model import (
        ATTENTION_NAME,
        CausalLMLoss,
        build_model,
        decoder_layers,
        model_batch,
        register_attention,
    )

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    register_attention()
    monkeypatch.setitem(AttentionInterface._global_mapping, ATTENTION_NAME, AttentionInterface[ATTENTION_NAME])
    dev = torch.device(device)
    layers = decoder_layers(build_model("tiny-llama", vocab_size=100, packed=True))
    assert not attention_in_graph(layers, torch.device("cpu"), torch.float32)  # the CPU default: the sdpa reference
    monkeypatch.setenv("SFTFLOW_ATTENTION", "sdpa")
    assert not attention_in_graph(layers, dev, torch.float32)
    monkeypatch.setenv("SFTFLOW_ATTENTION", "triton")  # on CPU through the interpreter (conftest)
    assert attention_in_graph(layers, dev, torch.float32)

    g = np.random.default_rng(0)
    docs = [(g.integers(0, 100, n), np.array([[n // 3, n]], dtype=np.int32)) for n in (7, 1, 12, 5)]
    batch = model_batch(collate(docs, packed_collator()), dev)

    def run(compiled: bool):
        torch.manual_seed(0)
        lm = build_model("tiny-llama", vocab_size=100, packed=True).to(dev)
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            assert compile_layers(decoder_layers(lm), device=dev, dtype=torch.float32)
        model = CausalLMLoss(lm)
        loss = model(**batch)
        loss.backward()
        if compiled:
            assert not counters["graph_break"], dict(counters["graph_break"])
            assert counters["stats"]["unique_graphs"] >= 1
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    try:
        (loss_e, grads_e), (loss_c, grads_c) = run(False), run(True)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
    for name, grad in grads_e.items():
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-4, atol=1e-5, msg=name)


@needs_triton
def test_the_attention_ops_count_their_flops():
    """torch's flop counter, and the compiler's choice of what to recompute, see the attention's cost: each query over
    half the longest document (or window), two products in the forward and five in the backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    import sftflow.kernels.attention_triton  # noqa: F401  (registers the ops)

    T, H, K, D = 4096, 8, 2, 64
    with FakeTensorMode():
        q, k, cu = torch.empty(T, H, D), torch.empty(T, K, D), torch.zeros(3, dtype=torch.int32)
        with FlopCounterMode(display=False) as forward:
            o, lse = torch.ops.sftflow.varlen_attention(q, k, k, cu, 1024, 0.125, 2**30)
        with FlopCounterMode(display=False) as windowed:
            torch.ops.sftflow.varlen_attention(q, k, k, cu, 1024, 0.125, 256)
        with FlopCounterMode(display=False) as backward:
            torch.ops.sftflow.varlen_attention_backward(o, q, k, k, o, lse, cu, 1024, 0.125, 2**30)
    assert forward.get_total_flops() == 2 * 2 * T * H * D * 512
    assert windowed.get_total_flops() == 2 * 2 * T * H * D * 128
    assert backward.get_total_flops() == 5 * forward.get_total_flops() // 2
