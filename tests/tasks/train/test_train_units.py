"""Training pieces in one process: document isolation of packed rows, padded mode, config validation, schedules,
metrics averages, checkpoint component checks and the launcher's process-group handling."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from sftflow.tasks.train.collate import collate, packed_collator, padded_collator
from sftflow.tasks.train.config import ScheduleConfig, TrainConfig
from sftflow.tasks.train.model import CausalLMLoss, build_model, check_model, model_batch

CPU = torch.device("cpu")


def _docs(lengths, vocab=100, seed=0):
    rng = np.random.default_rng(seed)
    docs = []
    for n in lengths:
        ids = rng.integers(0, vocab, n)
        docs.append((ids, np.array([[n // 3, n]], dtype=np.int32)))  # train the last two thirds, like a reply
    return docs


def _model(packed: bool) -> CausalLMLoss:
    torch.manual_seed(0)
    return CausalLMLoss(build_model("tiny-llama", vocab_size=100, packed=packed))


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_packed_row_loss_and_grads_equal_each_document_alone():
    model = _model(packed=True)
    docs = _docs([7, 1, 12, 5, 9])
    per_doc = []
    for doc in docs:
        model.zero_grad()
        loss = model(**model_batch(collate([doc], packed_collator()), CPU))
        loss.backward()
        per_doc.append((loss.detach(), _grads(model)))
    model.zero_grad()
    batch = collate(docs, packed_collator())
    packed = model(**model_batch(batch, CPU))
    packed.backward()
    alone = sum(loss for loss, _ in per_doc)
    assert batch["num_loss_tokens"] == sum(collate([d], packed_collator())["num_loss_tokens"] for d in docs)
    assert abs(packed.item() - alone.item()) <= 1e-5 * abs(alone.item())
    packed_grads = _grads(model)
    for name, grad in packed_grads.items():
        summed = sum(g[name] for _, g in per_doc if name in g)
        torch.testing.assert_close(grad, summed, rtol=1e-5, atol=1e-6)


def test_padded_mode_gives_the_same_loss_as_packed_rows():
    docs = _docs([7, 3, 12, 5])
    packed = _model(packed=True)(**model_batch(collate(docs, packed_collator()), CPU))
    padded = _model(packed=False)(**model_batch(collate(docs, padded_collator()), CPU))
    torch.testing.assert_close(padded, packed, rtol=1e-5, atol=1e-6)


def test_model_batch_finds_the_trained_rows_and_checks_their_labels_on_the_host():
    for collator in (packed_collator(), padded_collator()):
        batch = collate(_docs([7, 3, 12]), collator)
        moved = model_batch(batch, CPU, vocab_size=100)
        flat = batch["labels"].reshape(-1)
        assert torch.equal(moved["loss_rows"], (flat != -100).nonzero().squeeze(1))
        assert moved["loss_rows"].numel() == batch["num_loss_tokens"]
    with pytest.raises(ValueError, match=r"labels: value \d+ is outside \[0, 10\)"):
        model_batch(batch, CPU, vocab_size=10)


def test_all_masked_micro_batch_is_a_graph_connected_zero():
    model = _model(packed=True)
    ids = np.arange(6)
    batch = collate([(ids, np.zeros((0, 2), dtype=np.int32))], packed_collator())
    loss = model(**model_batch(batch, CPU))
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert all(torch.isfinite(p.grad).all() and not p.grad.any() for p in model.parameters() if p.grad is not None)


def test_varlen_attention_refuses_a_row_without_document_boundaries():
    model = _model(packed=True)
    batch = model_batch(collate(_docs([5, 6]), packed_collator()), CPU)
    batch.pop("cu_seqlens"), batch.pop("max_seqlen")
    with pytest.raises(ValueError, match="refusing to attend across documents"):
        model(**batch)


def test_packing_needs_a_model_that_takes_custom_attention():
    torch.manual_seed(0)
    lm = build_model("tiny-llama", vocab_size=100, packed=False)
    lm._supports_attention_backend = False
    with pytest.raises(ValueError, match="mode='padded'"):
        check_model(lm, packed=True, vocab_size=100, spec="tiny-llama")
    with pytest.raises(ValueError, match="vocab_size=100"):
        check_model(build_model("tiny-llama", vocab_size=100, packed=False), packed=False, vocab_size=500, spec="x")


def _config(**kw) -> TrainConfig:
    base = dict(data="d", plan="p", model="tiny-llama", out="o")
    return TrainConfig.model_validate({**base, **kw})


def test_config_validation_names_the_field():
    assert _config(checkpoint=dict(load_components="model,optimizer")).checkpoint.load_components == (
        "model",
        "optimizer",
    )
    with pytest.raises(ValueError, match="unknown component.*'optimiser'"):
        _config(checkpoint=dict(load_components=["model", "optimiser"]))
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        _config(nnodes=2)
    with pytest.raises(ValueError, match="node_rank=2"):
        _config(nnodes=2, node_rank=2, rdzv_endpoint="h:1", rdzv_id="r")


def test_launcher_imports_without_prefect():
    """GPU images may lack prefect: the launcher (torchrun command, streaming, run.json) must not need it to import."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'prefect' or name.startswith('prefect.'):\n"
        "            raise ImportError('prefect blocked by the test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import sftflow.tasks.train.launch as launch\n"
        "print(launch.torchrun_command.__name__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "torchrun_command"


def test_torchrun_command_single_and_multi_node():
    from sftflow.tasks.train.launch import torchrun_command

    single = torchrun_command(_config(nproc=4), Path("/run"))
    assert single[1:3] == ["-m", "sftflow.tasks.train.torchrun"]  # torchrun that dies with its launcher
    assert "--standalone" in single and "--nproc-per-node=4" in single
    assert single[-3:] == ["-m", "sftflow.tasks.train.worker", "/run"]
    multi = torchrun_command(_config(nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500", rdzv_id="job7"), Path("/r"))
    assert "--standalone" not in multi
    for flag in (
        "--nnodes=2",
        "--node-rank=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.0.0.1:29500",
        "--rdzv-id=job7",
    ):
        assert flag in multi


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    from sftflow.tasks.train.worker import lr_factor

    c = ScheduleConfig(kind="cosine", warmup_steps=4, total_steps=20, min_lr_ratio=0.1)
    factors = [lr_factor(s, c) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(factors[3:], factors[4:], strict=False))
    assert lr_factor(20, c) == pytest.approx(0.1)
    linear = ScheduleConfig(kind="linear", warmup_steps=0, total_steps=10, min_lr_ratio=0.0)
    assert lr_factor(5, linear) == pytest.approx(0.5)


def test_bias_corrected_ema_starts_at_the_first_value():
    from sftflow.tasks.train.metrics import BiasCorrectedEMA

    ema = BiasCorrectedEMA(alpha=0.9)
    assert ema.update(2.0) == pytest.approx(2.0)  # not 0.2: the zero start is corrected away
    for _ in range(5):
        assert ema.update(2.0) == pytest.approx(2.0)
    assert 2.0 < ema.update(4.0) < 4.0


def test_checkpoint_lacking_a_component_is_a_clear_error(tmp_path):
    import torch.distributed.checkpoint as dcp

    from sftflow.tasks.train.checkpoint import check_components, resolve_checkpoint

    lm = build_model("tiny-llama", vocab_size=100, packed=False)
    dcp.save({"model": lm.state_dict()}, checkpoint_id=str(tmp_path / "step-3"), no_dist=True)
    check_components(tmp_path / "step-3", ("model",))
    with pytest.raises(ValueError, match=r"has no \['optimizer'\]"):
        check_components(tmp_path / "step-3", ("model", "optimizer"))
    with pytest.raises(ValueError, match="not a DCP checkpoint"):
        resolve_checkpoint(tmp_path)


def test_existing_run_is_not_overwritten_without_resume(tmp_path):
    from sftflow.tasks.train.launch import train

    step = tmp_path / "checkpoints" / "step-2"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    (tmp_path / "checkpoints" / "latest").write_text("step-2")
    with pytest.raises(ValueError, match="pass resume=True"):
        train(_config(out=str(tmp_path)))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state


def test_timeout_kills_the_whole_process_group():
    from sftflow.tasks.train.launch import run_streaming

    lines = []
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="timeout_s=1"):
        run_streaming(["bash", "-c", "sleep 60 & echo $!; wait"], dict(os.environ), 1.0, lines.append)
    grandchild = int(lines[0])
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("prefect_handler", [False, True])
def test_sigterm_kills_the_whole_process_group(tmp_path, prefect_handler):
    """A plain launcher (SIGTERM at its default) and one inside a Prefect flow run (Prefect's handler, which raises
    `TerminationSignal` and is kept) both kill torchrun's group on SIGTERM before they exit."""
    import signal
    import subprocess
    import sys

    install = "from prefect.utilities.engine import capture_sigterm as scope" if prefect_handler else "scope = None"
    script = tmp_path / "launcher.py"
    script.write_text(
        "import contextlib, os, sys\n"
        "from sftflow.tasks.train.launch import run_streaming\n"
        f"{install}\n"
        "with scope() if scope else contextlib.nullcontext():\n"
        "    run_streaming(['bash', '-c', 'sleep 60 & echo $!; wait'], dict(os.environ), None,\n"
        "                  lambda line: print(line, flush=True))\n"
    )
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    grandchild = int(launcher.stdout.readline())
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_streaming_returns_the_exit_code_and_every_line():
    from sftflow.tasks.train.launch import run_streaming

    lines = []
    code = run_streaming(["bash", "-c", "echo one; echo two >&2; exit 3"], dict(os.environ), None, lines.append)
    assert code == 3 and sorted(lines) == ["one", "two"]


@pytest.mark.parametrize("tied", [False, True])
def test_count_params_counts_the_tied_head_as_a_matmul(tied):
    from transformers import AutoModelForCausalLM

    from sftflow.tasks.tiny import tiny_llama_config
    from sftflow.tasks.train.model import count_params

    model = AutoModelForCausalLM.from_config(tiny_llama_config(100, tie_word_embeddings=tied))
    total, dense = count_params(model)
    embed = 100 * model.config.hidden_size
    assert total == sum(p.numel() for p in model.parameters())
    # Untied: the head is its own (V, D) matrix and the embedding lookup is not a matmul. Tied: one shared matrix,
    # which the head uses as a matmul.
    assert dense == (total if tied else total - embed)


def test_cpu_workers_sleep_rather_than_spin_unless_told(monkeypatch):
    """A CPU worker's OpenMP threads wait passively (spinning ones collapse the step on a busy machine); a value the
    user set is kept, and a GPU run is left to OpenMP's default."""
    from sftflow.tasks.train.launch import _worker_env

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the config's thread count wins over the environment's
    cpu = _config(device="cpu", num_threads=2)
    env = _worker_env(cpu)
    assert (env["OMP_WAIT_POLICY"], env["OMP_NUM_THREADS"]) == ("PASSIVE", "2")
    assert _worker_env(cpu.model_copy(update={"num_threads": None}))["OMP_NUM_THREADS"] == "1"
    assert "OMP_WAIT_POLICY" not in _worker_env(cpu.model_copy(update={"device": "cuda"}))
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert _worker_env(cpu)["OMP_WAIT_POLICY"] == "ACTIVE"


def test_gpu_workers_get_expandable_segments_unless_the_user_set_the_allocator(monkeypatch):
    """A GPU run's caching allocator grows segments in place (packed rows of varying length strand memory in fixed
    segments); a setting the user made under either of torch's names is kept, and a CPU run is left alone."""
    from sftflow.tasks.train.launch import ALLOC_CONF_VARS, _worker_env

    for name in ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    gpu = _config(device="cuda", num_threads=2)
    env = _worker_env(gpu)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True" and "PYTORCH_ALLOC_CONF" not in env
    assert not set(ALLOC_CONF_VARS) & set(_worker_env(gpu.model_copy(update={"device": "cpu"})))
    for name in ALLOC_CONF_VARS:
        monkeypatch.setenv(name, "expandable_segments:False")
        env = _worker_env(gpu)
        assert env[name] == "expandable_segments:False"
        assert set(ALLOC_CONF_VARS) & set(env) == {name}
        monkeypatch.delenv(name)


def test_worker_threads_follow_the_cpus_this_process_may_use(monkeypatch):
    """Without a thread count anywhere, each worker gets its share of the CPUs in the process's affinity mask (a
    container's limit), not of the host's cores."""
    import os

    from sftflow.tasks.train import launch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    cpu = _config(device="cpu", num_threads=None, nproc=2)
    assert launch.usable_cpus() == 4
    assert launch._worker_env(cpu)["OMP_NUM_THREADS"] == "2"
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # no affinity API: the CPU count
    assert launch._worker_env(cpu)["OMP_NUM_THREADS"] == "32"


def test_attention_cost_counts_only_the_keys_inside_a_window():
    """The MFU's attention term in full causal attention's L**2 units: L**2 for a document inside the window,
    2*L*W - W**2 past it (each query sees W keys), weighted by the share of windowed layers."""
    from sftflow.tasks.train.worker import AttentionSpan

    lengths = torch.tensor([3.0, 10.0], dtype=torch.float64)
    assert AttentionSpan().cost(lengths).item() == 9 + 100
    assert AttentionSpan.of([None, None]) == AttentionSpan()
    every = AttentionSpan.of([4, 4])
    assert (every.windowed, every.window) == (1.0, 4)
    assert every.cost(lengths).item() == 9 + (2 * 10 * 4 - 16)
    half = AttentionSpan.of([None, 4, None, 4])  # Gemma-style interleaving
    assert half.cost(lengths).item() == pytest.approx(0.5 * 109 + 0.5 * 73)
    # Against the query-key pairs a window keeps, counted one by one (L**2 ~ twice the causal pairs).
    for length, window in ((1000, 100), (300, 1000)):
        pairs = sum(min(i + 1, window) for i in range(length))
        got = AttentionSpan.of([window]).cost(torch.tensor([float(length)], dtype=torch.float64)).item()
        assert got == pytest.approx(2 * pairs, rel=0.01)


@pytest.mark.parametrize(
    ("enabled", "every", "saved_last", "due", "last"),
    [
        (True, 2, None, [False, True, False, True], True),  # every 2 steps; the last step, not yet saved
        (True, 2, 4, [False, True, False, True], False),  # the last step already saved by `every`
        (True, 0, None, [False, False, False, False], True),  # only the last step
        (False, 2, None, [False, False, False, False], False),  # checkpointing off: never
    ],
)
def test_checkpointer_due_and_its_look_ahead_agree(tmp_path, enabled, every, saved_last, due, last):
    """`due` (asked once a step is complete) and `will_save` (asked ahead, by a loop that queues steps) give the
    same answer for every step; only `due(last=True)` adds the final save."""
    from sftflow.tasks.train.checkpoint import Checkpointer
    from sftflow.tasks.train.config import COMPONENTS, CheckpointConfig

    config = CheckpointConfig(
        folder=tmp_path, every=every, keep_last=2, resume=False, enabled=enabled, init_from=None, load_components=()
    )
    checkpointer = Checkpointer(config, dict.fromkeys(COMPONENTS), is_main=True)
    checkpointer.last_saved_step = saved_last
    assert [checkpointer.due(step) for step in (1, 2, 3, 4)] == due
    assert [checkpointer.will_save(step) for step in (1, 2, 3, 4)] == due
    assert checkpointer.due(4, last=True) is last
