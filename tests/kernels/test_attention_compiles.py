"""The Triton kernels compile for sm_90 (H100/H200) on this GPU-less machine, and every shipped attention block shape
fits its shared memory: what the CPU interpreter cannot see (`sftflow.kernels.aot`, run in a child process because the
tests define the kernels under ``TRITON_INTERPRET``)."""

from __future__ import annotations

import pytest

SM90 = 90  # H100 and H200


def _nvidia_backend() -> bool:
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _nvidia_backend(), reason="no triton, or triton without its NVIDIA backend")


def _packed_gqa_cases() -> list[dict]:
    from sftflow.kernels.attention_triton import CONFIGS

    cases = []
    for D in (64, 128):
        base = CONFIGS[(D, True)]
        for rows in (64, 128):
            config = {**base, **{part: {**base[part], "PACK": True, "BLOCK_M": rows} for part in ("fwd", "dq")}}
            config["dkdv"] = {**base["dkdv"], "PACK": True}
            cases.append(dict(label=f"pack D={D} rows={rows}", D=D, group=4, config=config))
    return cases


def _pointer_cases() -> list[dict]:
    """Every shipped config with its tiles through pointers instead of TMA descriptors (tensors that descriptors cannot
    cover, GPUs before Hopper)."""
    from sftflow.kernels.aot import shipped_cases
    from sftflow.kernels.attention_triton import with_flags

    return [
        dict(case, label=f"{case['label']} pointers", config=with_flags(case["config"], TMA=False))
        for case in shipped_cases()
    ]


# The D=256 split dK pass with 64x128 tiles ran out of shared memory on the H200 (benchmarks/RESULTS.md, "D=256 split
# dK/dV"): compiled here, it must ask for more than sm_90 has, or the limit check could never fail.
def _too_big_case() -> dict:
    from sftflow.kernels.attention_triton import CONFIGS

    tiles = dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2, ORDER="row", SPLIT=True)
    return dict(label="too big", D=256, group=2, config={**CONFIGS[(256, True)], "dkdv": tiles})


@pytest.fixture(scope="session")
def compiled(tmp_path_factory, worker_id):
    """Every case compiled once per test session: under xdist the first worker compiles and the others read its
    results (the folder above each worker's base temp is shared)."""
    import json

    from filelock import FileLock

    from sftflow.kernels.aot import compile_in_child, shipped_cases

    def compile_all():
        cases = [*shipped_cases(), *_packed_gqa_cases(), *_pointer_cases(), _too_big_case()]
        results = compile_in_child(cases, SM90, others=True)
        return {case["label"]: case for case in results}

    if worker_id == "master":
        return compile_all()
    shared = tmp_path_factory.getbasetemp().parent / "attention-sm90.json"
    with FileLock(str(shared) + ".lock"):
        if not shared.is_file():
            shared.write_text(json.dumps(compile_all()))
        return json.loads(shared.read_text())


def _kernels(case: dict) -> dict[str, dict]:
    assert "error" not in case, f"{case['label']} does not compile: {case.get('error')}"
    return {k["name"]: k for k in case["kernels"]}


def _assert_every_kernel_fits(compiled, cases: list[dict]) -> None:
    from sftflow.kernels.aot import SHARED_MEMORY

    for case in cases:
        for name, kernel in _kernels(compiled[case["label"]]).items():
            assert 0 < kernel["shared"] <= SHARED_MEMORY[SM90], (case["label"], name, kernel)


def test_every_shipped_config_compiles_and_fits_shared_memory(compiled):
    from sftflow.kernels.aot import shipped_cases

    for case in shipped_cases():
        kernels = _kernels(compiled[case["label"]])
        assert {"fwd", "dq"} <= kernels.keys() and ({"dkdv"} <= kernels.keys() or {"dv", "dk"} <= kernels.keys())
    _assert_every_kernel_fits(compiled, shipped_cases())


def test_packed_gqa_query_programs_compile(compiled):
    """PACK changes the kernels' query rows and head offsets: it must lower, not only interpret."""
    _assert_every_kernel_fits(compiled, _packed_gqa_cases())


def test_pointer_tiles_compile_and_fit(compiled):
    """Without descriptors the tiles' loads and stores are pointer arithmetic and masks: that path must lower too."""
    _assert_every_kernel_fits(compiled, _pointer_cases())


def test_the_cross_entropy_rope_and_adamw_kernels_compile_and_fit(compiled):
    from sftflow.kernels.aot import SHARED_MEMORY

    kernels = _kernels(compiled["others"])
    assert {"cross-entropy", "cross-entropy + accuracy", "cross-entropy scale", "rope", "adamw"} <= kernels.keys()
    for name, kernel in kernels.items():
        assert kernel["shared"] <= SHARED_MEMORY[SM90], (name, kernel)


def test_a_config_that_failed_to_launch_on_the_h200_is_over_the_limit(compiled):
    from sftflow.kernels.aot import SHARED_MEMORY

    kernels = _kernels(compiled["too big"])
    assert kernels["dk"]["shared"] > SHARED_MEMORY[SM90]
    assert kernels["dv"]["shared"] <= SHARED_MEMORY[SM90]
