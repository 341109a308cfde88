"""Running out of memory: the report a worker gives (where, torch's sizes, sftflow's estimate, what leaves more
room), from real allocation failures where this machine can make them (the CPU allocator's)."""

from __future__ import annotations

import re

import pytest
import torch

from sftflow.tasks.tiny import tiny_llama_config
from sftflow.tasks.train.launch import ALLOC_CONF_VARS
from sftflow.tasks.train.oom import MemoryPicture, MemoryWatch, OutOfMemory, is_out_of_memory, more_room, report

GIB = 2**30
# torch's CUDA message as the caching allocator words it (torch 2.11), for the part of the report that reads it
CUDA_MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.03 GiB is "
    "free. Process 4242 has 78.15 GiB memory in use. Of the allocated memory 75.20 GiB is allocated by PyTorch, and "
    "1.50 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)


def _picture(**changes) -> MemoryPicture:
    """A 1B-like shape on one 80 GB GPU, rows of 64k tokens, nothing checkpointed."""
    fields = dict(
        model_config=tiny_llama_config(
            128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
            num_key_value_heads=8,
        ),
        tokens_per_rank=65536, parallel="single", world_size=1, checkpointing="off", offload=False, compiled=True,
        budget=1.0, state_bytes=17.3 * GIB, free_bytes=int(79 * GIB), optimizer_in_backward=False,
        optimizer_offload="off", lora=False,
    )  # fmt: skip
    return MemoryPicture(**{**fields, **changes})


def _cpu_allocation_failure() -> RuntimeError:
    """The CPU allocator's own failure: far more than any machine has, refused at once (nothing is touched)."""
    try:
        torch.empty(2**52, dtype=torch.uint8)
    except RuntimeError as err:
        return err
    pytest.skip("this machine allocated 4 PiB")


def test_allocation_failures_are_told_from_other_errors():
    assert is_out_of_memory(_cpu_allocation_failure())
    assert is_out_of_memory(torch.OutOfMemoryError(CUDA_MESSAGE))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("can't allocate memory"))


def test_a_gpu_report_gives_torchs_sizes_the_estimate_and_what_leaves_more_room(monkeypatch):
    for name in ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    line = report(torch.OutOfMemoryError(CUDA_MESSAGE), 1, "cuda:1", "in step 12", _picture())
    assert "\n" not in line  # the launcher and the CLI show one line
    assert line.startswith("out of GPU memory on rank 1 (cuda:1) in step 12: Tried to allocate 2.00 GiB")
    assert "GPU 0 has a total capacity of 79.19 GiB of which 1.03 GiB is free" in line
    assert (
        "1.50 GiB reserved but unallocated (fragmentation: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)"
        in line
    )
    small = CUDA_MESSAGE.replace("1.50 GiB is reserved", "20.00 MiB is reserved")
    assert "fragmentation" not in report(torch.OutOfMemoryError(small), 1, "cuda:1", "in step 12", _picture())
    assert "Rows of 65,536 tokens, activation checkpointing off, single path on 1 process(es)" in line
    assert "17.3 GiB of weights and optimizer state" in line and "against 71.1 GiB usable of 79.0 free" in line
    # the longest row full checkpointing fits in this memory, from the same estimate `auto` uses
    assert "(with full checkpointing rows up to " in line
    for option in (
        "train.memory.activation_checkpointing: full",
        "train.memory.activation_memory_budget: 0.99",
        "train.optimizer.in_backward: true",
        "train.optimizer.offload: all",
        "a smaller plan.tokens_per_rank (now 65,536",
        "train.lora",
    ):
        assert option in line, option
    assert "activation_offload" not in line  # nothing is checkpointed, so nothing would be offloaded
    # Under the launcher's default (or the user's own setting) the pointer would be advice already taken.
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:512, expandable_segments:True")
    on = report(torch.OutOfMemoryError(CUDA_MESSAGE), 1, "cuda:1", "in step 12", _picture())
    assert "1.50 GiB reserved but unallocated (fragmentation, with expandable segments already on)" in on
    assert "set PYTORCH_CUDA_ALLOC_CONF" not in on


def test_the_options_leave_out_what_the_run_already_has():
    options = " ".join(
        more_room(_picture(checkpointing="full", offload=True, optimizer_in_backward=True, optimizer_offload="all"))
    )
    for already in ("activation_checkpointing", "activation_offload", "optimizer_in_backward", "optimizer_offload"):
        assert already not in options
    assert "activation_memory_budget" not in options  # every layer recomputed: no kept activations to shrink
    assert "plan.tokens_per_rank" in options and "train.lora" in options
    lora = " ".join(more_room(_picture(lora=True, checkpointing="selective")))
    assert "train.lora" not in lora and "optimizer_in_backward" not in lora  # adapters' optimizer state is small
    assert "train.memory.activation_offload: true" in lora and "activation_checkpointing: full" in lora
    fsdp = " ".join(more_room(_picture(parallel="fsdp", world_size=2)))
    assert "optimizer_in_backward" not in fsdp and "optimizer_offload" not in fsdp  # one-GPU path options


def test_the_watch_turns_a_real_allocation_failure_into_a_located_report():
    watch = MemoryWatch(rank=0, device="cpu")
    watch.where, watch.picture = "in step 3", _picture(free_bytes=None, compiled=False)
    with pytest.raises(OutOfMemory) as caught:
        with watch:
            torch.empty(2**52, dtype=torch.uint8)
    line = str(caught.value)
    assert line.startswith("out of host memory on rank 0 (cpu) in step 3: you tried to allocate 4503599627370496")
    assert "sftflow's estimate" in line and "usable" not in line  # no device memory figure on a CPU
    assert isinstance(caught.value, ValueError)  # so the train stage's retries leave it alone
    assert isinstance(caught.value.__cause__, RuntimeError)
    with pytest.raises(KeyError):  # anything else goes through as it was
        with watch:
            raise KeyError("x")


@pytest.mark.gpu
def test_a_real_cuda_allocation_failure_is_reported_with_torchs_sizes():
    """The report reads torch's own CUDA message: what was asked for and what the GPU had."""
    watch = MemoryWatch(rank=0, device="cuda:0")
    watch.where, watch.picture = "in step 1", _picture()
    with pytest.raises(OutOfMemory) as caught:
        with watch:
            torch.empty(2**45, dtype=torch.uint8, device="cuda")  # 32 TiB
    line = str(caught.value)
    assert re.match(
        r"out of GPU memory on rank 0 \(cuda:0\) in step 1: Tried to allocate [\d.]+ [KMGT]iB; GPU 0 has", line
    )
    assert "of which" in line and "is free" in line and "More room: " in line
