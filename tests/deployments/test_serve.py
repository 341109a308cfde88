"""Deployments for real: a `prefect server`, `deployments/serve.py`, and `prefect deployment run ... --watch`.

One server and one served process for the whole module, and pipeline runs as small as a run can be (40 demo
records, two training steps of a one-layer model, four eval documents): the tests prove the wiring, not the model.
Everything runs on this machine's loopback address and is shut down by PID at the end (serve first, then server).
The CLI is used where the test is about what a user types; the state checks read the REST API, each CLI call costing
seconds of start-up on a small machine.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
import threading
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.conftest import crash_env
from tests.deployments.browser import chromium_path, show_run_artifacts
from tests.deployments.conftest import stop, wait_for

REPO = Path(__file__).resolve().parents[2]
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
DEPLOYMENTS = (
    "sft/full",
    "sft-data/refresh",
    "sft-plan/rerun",
    "sft-train/rerun",
    "sft-eval/rerun",
    "sft-bench/rerun",
    "sft/promote",
    "sft-promote/gate",
    "sft-refresh/chain",
    "sft-check/gate",
)
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
CRASH_LR = 7e-4  # the run with this learning rate crashes after step 1, once (tests/crash_shim); the others do not
STEP_LINE = re.compile(r"step (\d+)/(\d+) loss ")  # `progress_log.progress_line`


@dataclass
class Served:
    """The server's API, the environment that reaches it, and the process that serves the deployments."""

    api: str
    env: dict
    work: Path
    log: Path

    def get(self, path: str, body: dict | None = None):
        """GET `path` of the API, or POST `body` to it."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.api + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as r:
            return json.load(r)

    def prefect(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(["prefect", *args], env=self.env, capture_output=True, text=True, timeout=timeout)

    def state(self, flow_run_id: str) -> str | None:
        state = self.get(f"/flow_runs/{flow_run_id}")["state"]
        return state and state["type"]

    def final_state(self, flow_run_id: str, timeout_s: float = 600) -> str:
        final = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
        return wait_for(
            lambda: self.state(flow_run_id) in final and self.state(flow_run_id), timeout_s, "a final state"
        )

    def serve_log(self) -> str:
        return self.log.read_text()


@pytest.fixture(scope="module")
def served(prefect_server, tmp_path_factory) -> Served:
    root = tmp_path_factory.mktemp("served")
    config = root / "tiny.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "work_dir": str(root / "work"),
                "train_retries": 0,  # so that the injected crash fails the flow run
                "demo": {"records": 40},
                "plan": {"tokens_per_rank": 512},
                "train": {
                    "model_overrides": TINY,
                    "optimizer": {"lr": 1e-3},
                    "max_steps": 2,
                    "checkpoint": {"every": 1},
                },
                "eval": {"max_docs": 4, "max_generations": 1, "num_examples": 1},
            }
        )
    )
    serve_env = crash_env(f"crash_after_step=1,lr={CRASH_LR}", dict(prefect_server, SFTFLOW_CONFIG=str(config)))
    log_path = root / "serve.log"
    log = open(log_path, "w")
    serve = subprocess.Popen(
        [sys.executable, str(REPO / "deployments" / "serve.py")],
        env=serve_env,
        cwd=root,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    it = Served(api=prefect_server["PREFECT_API_URL"], env=prefect_server, work=root / "work", log=log_path)

    def all_served() -> bool:
        assert serve.poll() is None, log_path.read_text()[-3000:]
        names = {f"{d['flow_name']}/{d['name']}" for d in _deployments(it)}
        return names >= set(DEPLOYMENTS)

    try:
        wait_for(all_served, 180, "the served deployments")
        yield it
    finally:
        stop(serve)
        log.close()


def _deployments(served: Served) -> list[dict]:
    flows = {f["id"]: f["name"] for f in served.get("/flows/filter", {})}
    return [dict(d, flow_name=flows.get(d["flow_id"])) for d in served.get("/deployments/filter", {})]


@pytest.fixture(scope="module")
def full_run(served) -> tuple[str, subprocess.CompletedProcess]:
    """`prefect deployment run sft/full --watch`, once for the module: (flow run id, the command's result)."""
    run = served.prefect("deployment", "run", "sft/full", "--watch", "--watch-timeout", "900", timeout=960)
    assert run.returncode == 0, run.stdout + run.stderr + served.serve_log()[-4000:]
    return re.search(UUID, run.stdout).group(0), run


@pytest.mark.slow
def test_serve_registers_every_deployment_and_the_nightly_schedule(served):
    refresh = served.get("/deployments/name/sft-data/refresh")
    assert [s["schedule"].get("cron") for s in refresh["schedules"]] == ["0 3 * * *"]


@pytest.mark.slow
def test_deployment_run_watch_shows_training_progress_and_completes(served, full_run):
    flow_run_id, run = full_run
    assert "Completed" in run.stdout
    assert (served.work / "eval.json").is_file()
    # The train task's step lines belong to the sft-train subflow run; the parent's log (which `--watch` follows)
    # carries them too: the first and the last step at least.
    parent_steps = {m.group(1, 2) for m in STEP_LINE.finditer(run.stdout)}
    assert {("1", "2"), ("2", "2")} <= parent_steps, run.stdout
    logs = served.get("/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}})
    assert any(log["message"].startswith("sft-train step ") and log["task_run_id"] is None for log in logs), logs


@pytest.mark.slow
def test_parent_run_carries_the_loss_curve_and_links_to_the_stage_runs(served, full_run):
    flow_run_id, _ = full_run
    artifacts = served.get("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
    by_key = {a["key"]: a for a in artifacts}
    assert by_key["sft-loss-curve"]["type"] == "image"
    assert by_key["sft-loss-curve"]["data"].startswith("data:image/png;base64,iVBORw0KGgo")  # a PNG's signature
    summary = by_key["sft-summary"]["data"]
    children = served.get("/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [flow_run_id]}}})
    ui = served.api.removesuffix("/api")
    for child in children:
        assert f"]({ui}/runs/flow-run/{child['id']})" in summary
    train_run = next(c for c in children if _flow_name(served, c) == "sft-train")
    train_artifacts = served.get("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [train_run["id"]]}}})
    assert {"train-metrics", "train-progress"} <= {a["key"] for a in train_artifacts}
    for artifact in train_artifacts:
        assert f"]({ui}/artifacts/artifact/{artifact['id']})" in summary


def _flow_name(served: Served, flow_run: dict) -> str:
    return served.get(f"/flows/{flow_run['flow_id']}")["name"]


@pytest.mark.slow
@pytest.mark.skipif(chromium_path() is None, reason="needs chromium (apt-get install -y chromium)")
def test_run_page_shows_the_loss_curve_and_eval_table_in_a_browser(served, full_run, tmp_path):
    flow_run_id, _ = full_run
    shown = show_run_artifacts(served.api.removesuffix("/api"), flow_run_id, tmp_path)
    assert {"sft-summary", "sft-loss-curve"} <= set(shown["cards"]), shown["cards"]
    image = shown["artifacts"]["sft-loss-curve"]["images"]
    assert [i["width"] for i in image] == [700], image  # decoded: a broken image has width 0
    summary = shown["artifacts"]["sft-summary"]
    assert [i["width"] for i in summary["images"]] == [700]
    assert any("tuned" in table and "perplexity" in table for table in summary["tables"]), summary["tables"]
    assert "sft-train" in summary["text"]
    assert (tmp_path / "run-artifacts.png").stat().st_size > 10_000


@pytest.mark.slow
def test_stage_rerun_reads_the_latest_results_and_is_cached(served, full_run):
    rerun = served.prefect("deployment", "run", "sft-train/rerun", "--watch", "--watch-timeout", "300", timeout=360)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "Finished in state Cached" in served.serve_log()


@pytest.mark.slow
def test_failed_training_resumes_on_flow_run_retry(served):
    # The fault fires once per run folder, so the retry's training resumes from the checkpoint of step 1, without
    # redoing data or plan.
    started = served.prefect("deployment", "run", "sft/full", "-p", f"learning_rate={CRASH_LR}")
    assert started.returncode == 0, started.stdout + started.stderr
    flow_run_id = re.search(UUID, started.stdout).group(0)
    assert served.final_state(flow_run_id) == "FAILED"
    retried = served.prefect("flow-run", "retry", flow_run_id, timeout=120)
    assert retried.returncode == 0, retried.stdout + retried.stderr
    assert served.final_state(flow_run_id) == "COMPLETED", served.serve_log()[-4000:]
    assert re.search(r"resumed all components from \S*step-1", served.serve_log()), served.serve_log()[-4000:]


@pytest.mark.slow
def test_cancel_during_training_ends_cancelled_and_stops_torchrun(served):
    # Enough steps that training is still running when the cancel lands; the run is cancelled at its first step.
    log_start = len(served.serve_log())
    watch = subprocess.Popen(
        [  # the general form of a parameter override: any config key, as a JSON object
            *("prefect", "deployment", "run", "sft/full", "--watch"),
            *("-p", 'overrides={"plan.epochs": 400, "train.max_steps": 100000}'),
        ],
        env=served.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(watch.stdout), daemon=True)
    reader.start()
    try:
        flow_run_id = wait_for(lambda: re.search(UUID, "".join(lines)), 120, "the flow run id").group(0)
        wait_for(lambda: STEP_LINE.search("".join(lines)), 600, "training to start\n" + "".join(lines))
        cancelled = served.prefect("flow-run", "cancel", flow_run_id, timeout=120)
        assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
        assert served.final_state(flow_run_id, timeout_s=120) == "CANCELLED"
        watch.wait(timeout=120)
    finally:
        stop(watch)
    reader.join(timeout=10)
    # The stage runs, the parent and the train task end Cancelled, none Crashed. (Prefect's task engine records the
    # interrupted task as Crashed; sft-train records it as Cancelled when a cancel interrupted it.)
    children = served.get("/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [flow_run_id]}}})
    train_run = next(c for c in children if _flow_name(served, c) == "sft-train")
    assert train_run["state"]["type"] == "CANCELLED", train_run["state"]
    tasks = served.get("/task_runs/filter", {"flow_runs": {"id": {"any_": [train_run["id"]]}}})
    assert [t["state"]["type"] for t in tasks if t["name"].startswith("train")] == ["CANCELLED"], tasks
    log = served.serve_log()[log_start:]
    # sft-train's engine, then sft's, saw the cancel for what it was
    assert len(re.findall(r"Flow run '[^']*' - Flow run was cancelled\.", log)) == 2, log[-4000:]
    assert not re.search(r"Flow run '[^']*' - (Crash detected|Finished in state Crashed)", log), log[-4000:]
    assert "_Terminated" not in log and "_Cancelled" not in log, log[-4000:]
    assert "Finished in state Running()" not in log, log[-4000:]
    watched = "".join(lines)
    assert "Cancelled" in watched and "Crashed" not in watched, watched[-4000:]
    # No training worker of this run outlived it: the launcher killed torchrun's process group; and the flow run's
    # process let go of the work folder.
    wait_for(lambda: not _workers_under(served.work), 30, "the training workers to exit")
    wait_for(lambda: lock_free(served.work), 30, "the work folder's lock to be released")


def lock_free(work: Path) -> bool:
    """Whether no process holds the work folder's lock (`sftflow.flows.results.work_dir_lock`)."""
    with open(work / ".sftflow.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True


def _workers_under(work: Path) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "sftflow.tasks.train.worker" in cmdline and str(work) in cmdline:
            found.append(cmdline)
    return found


def test_prefect_yaml_deploys_to_a_process_pool(prefect_server):
    env = dict(prefect_server, SFTFLOW_HOME=str(REPO))

    def prefect(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["prefect", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)

    pool = prefect("work-pool", "create", "sftflow-process", "--type", "process")
    assert pool.returncode == 0, pool.stdout + pool.stderr
    deployed = prefect("--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml")
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    listing = prefect("deployment", "ls").stdout
    for name in DEPLOYMENTS:
        assert name in listing, listing


def test_serve_refuses_a_temporary_server_with_the_setting_to_make(tmp_path):
    """Followed without `PREFECT_API_URL`, serve.py would serve on a temporary server nobody can reach: it stops at
    once with one line that names the setting, and starts no server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    proc = subprocess.run(
        [sys.executable, str(REPO / "deployments" / "serve.py")], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: serve.py: PREFECT_API_URL is not set")
    assert "prefect config set PREFECT_API_URL=http://127.0.0.1:4200/api" in lines[0]
    assert "Starting temporary server" not in proc.stdout + proc.stderr
