"""Live tracking: while a run trains, the new steps of its `metrics.jsonl` reach the configured trackers every
`track.live_every_s` seconds, into one tracker run per training run, which the end-of-run send (`track_run`) then
completes with the config, the eval metrics, the plots and the model.

`run_dir/live_track.json` records, per tracker, the run opened and the last step it holds:

    [{"tracker": "mlflow", "target": "http://host:5000 (experiment sftflow)", "run_id": "4f1c...",
      "url": "http://host:5000/#/experiments/1/runs/4f1c...", "sent_through": 1200, "closed": false}, ...]

A resumed training run (a retry, `--resume`) continues the runs recorded there after step `sent_through`: the steps
it redoes after the checkpoint it resumes from are not sent twice. The end-of-run send adds the steps after
`sent_through` and sets `closed`; a closed run is complete, so a later send (another eval of the same model) is a run
of its own, as without live tracking.

All of it runs in one background thread of the launcher: a tracker that cannot be reached costs that thread its
timeouts, never the training loop, and is one warning per training attempt; the end-of-run send sends what it
missed.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from sftflow.tasks.core.atomic import write_atomic
from sftflow.tasks.core.logs import stage_logger
from sftflow.tasks.track.config import MLflowTarget, TrackConfig, WandbTarget
from sftflow.tasks.track.prefect_link import prefect_tags
from sftflow.tasks.track.record import step_rows
from sftflow.tasks.track.sinks import (
    check_reachable,
    mlflow_client,
    mlflow_experiment,
    mlflow_steps,
    mlflow_url,
    scoped_env,
    tensorboard_steps,
    tensorboard_writer,
    wandb_init,
    wandb_steps,
    wandb_url,
)

LIVE_STATE = "live_track.json"
# After training ends, how long the launcher waits for the last live send: what it misses, the end-of-run send sends.
STOP_WAIT_S = 30.0
# One try per request, answered within seconds: a slow tracker delays the next live send, nothing else.
_MLFLOW_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


class LiveRun(BaseModel):
    """The run a tracker holds for one training run, opened while it trained."""

    model_config = ConfigDict(frozen=True)
    tracker: str
    target: str  # `TrackConfig.targets` spelling: a run at another target is not continued
    run_id: str
    url: str | None = None
    sent_through: int = 0  # the last step the tracker holds
    closed: bool = False  # the end-of-run send completed it


def read_live_runs(run_dir: str | Path) -> dict[str, LiveRun]:
    path = Path(run_dir) / LIVE_STATE
    if not path.is_file():
        return {}
    return {r["tracker"]: LiveRun(**r) for r in json.loads(path.read_text())}


def write_live_runs(run_dir: str | Path, runs: dict[str, LiveRun]) -> None:
    write_atomic(Path(run_dir) / LIVE_STATE, json.dumps([r.model_dump() for r in runs.values()], indent=2))


def live_tracker(
    config: TrackConfig, work_dir: str | Path, finish: bool = False, end_runs: bool = False
) -> LiveTracker | None:
    """The live sender for a training run under `work_dir`, or None where the config tracks nothing live. With
    `finish` (training outside the pipeline: no eval will complete the runs) a trained run's tracker runs are
    finished and recorded closed when training ends. With `end_runs` (the train flow on its own, which a later
    pipeline run may evaluate) they are finished but stay open to that evaluation's send."""
    if not (config.enabled and config.live):
        return None
    return LiveTracker(config, Path(work_dir), finish=finish, end_runs=end_runs)


class _MetricsTail:
    """The whole lines appended to `metrics.jsonl` since the last read. A resumed run rewrites the file (dropping the
    steps after its checkpoint): a new file is read again from its start."""

    def __init__(self, path: Path, trusted_through: int | None = None):
        self.path, self.offset, self.inode = path, 0, None
        # A file left by an earlier attempt holds steps after the checkpoint the worker resumes from, which it
        # drops (rewriting the file) and trains again: until then, only the steps up to that checkpoint count.
        self.stale_inode = None
        if trusted_through is not None:
            try:
                self.stale_inode = path.stat().st_ino
            except FileNotFoundError:
                pass
        self.trusted_through = trusted_through or 0

    def read(self) -> tuple[list[dict], bool]:
        """(new records, whether the file was replaced since the last read)."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return [], False
        replaced = self.inode is not None and (stat.st_ino != self.inode or stat.st_size < self.offset)
        if replaced:
            self.offset = 0
        self.inode = stat.st_ino
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        records = []
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break  # being written: the next read takes it whole
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break  # cut short by a crash: the resumed run rewrites the file
                if stat.st_ino != self.stale_inode or record["step"] <= self.trusted_through:
                    records.append(record)
            self.offset += len(line)
        return records, replaced


class _Channel:
    """One tracker's live run: opened on the first tick that reaches the tracker, then sent each tick's new steps.
    Subclasses open, send to and close the tracker's own kind of run."""

    tracker = ""

    def __init__(self, target: str, name: str, tags: dict[str, str], earlier: LiveRun | None):
        self.target, self.name, self.tags, self.earlier = target, name, tags, earlier
        self.run: LiveRun | None = None
        self.pending: list[dict[str, float]] = []
        self.warned = False

    def tick(self, rows: list[dict[str, float]], replaced: bool, warn) -> bool:
        """Send the rows after the run's last step; True when the run's record changed (opened, or further along).
        A failure is one warning per attempt, and the next tick tries again."""
        if replaced:  # rows not sent from the old file are superseded by the rewritten one
            self.pending = []
        self.pending += rows
        changed = False
        try:
            if self.run is None:
                run_id, url = self._open(self.earlier.run_id if self.earlier else None)
                sent = self.earlier.sent_through if self.earlier else 0
                self.run = LiveRun(tracker=self.tracker, target=self.target, run_id=run_id, url=url, sent_through=sent)
                changed = True
            self.pending = [row for row in self.pending if row["step"] > self.run.sent_through]
            if self.pending:
                self._send(self.pending)
                self.run = self.run.model_copy(update={"sent_through": self.pending[-1]["step"]})
                self.pending = []
                changed = True
        except Exception as err:  # noqa: BLE001 -- live tracking never fails training; the run's end sends it
            if not self.warned:
                self.warned = True
                message = f"{type(err).__name__}: {err}".splitlines()[0]
                warn(
                    "track: %s at %s is not following this run live (%s); the run's end sends what it missed",
                    self.tracker, self.target, message,
                )  # fmt: skip
        return changed

    def close(self, trained: bool, finish: bool, warn, end: bool = False) -> None:
        """End the live run: `finish` also records it complete; `end` finishes it in the tracker only."""
        if self.run is None:
            return
        try:
            self._close(trained, finish or end)
        except Exception as err:  # noqa: BLE001 -- as for any live failure: the run's end completes the run
            warn("track: %s could not close its live run: %s", self.tracker, f"{type(err).__name__}: {err}")
            return
        if trained and finish:
            self.run = self.run.model_copy(update={"closed": True})

    def _open(self, run_id: str | None) -> tuple[str, str]:
        raise NotImplementedError

    def _send(self, rows: list[dict[str, float]]) -> None:
        raise NotImplementedError

    def _close(self, trained: bool, finish: bool) -> None:
        raise NotImplementedError


class _MLflow(_Channel):
    tracker = "mlflow"

    def __init__(self, config: MLflowTarget, *args):
        super().__init__(*args)
        self.config, self.client = config, None

    def _open(self, run_id):
        check_reachable(self.config.uri)
        with scoped_env(**_MLFLOW_ENV):
            client = mlflow_client(self.config.uri)
            if run_id is None:
                experiment_id = mlflow_experiment(client, self.config.experiment)
                run_id = client.create_run(experiment_id, run_name=self.name, tags=self.tags).info.run_id
            else:  # a resumed training run: its earlier attempt marked the run FAILED
                experiment_id = client.get_run(run_id).info.experiment_id
                client.update_run(run_id, status="RUNNING")
        self.client = client
        return run_id, mlflow_url(self.config, experiment_id, run_id)

    def _send(self, rows):
        with scoped_env(**_MLFLOW_ENV):
            mlflow_steps(self.client, self.run.run_id, rows)

    def _close(self, trained, finish):
        # In the pipeline a trained run stays RUNNING until the end-of-run send adds its eval and finishes it.
        if not trained or finish:
            with scoped_env(**_MLFLOW_ENV):
                self.client.set_terminated(self.run.run_id, status="FINISHED" if trained else "FAILED")


class _TensorBoard(_Channel):
    tracker = "tensorboard"

    def __init__(self, *args):
        super().__init__(*args)
        self.writer = None

    def _open(self, run_id):
        log_dir = Path(self.target) / (run_id or self.name)
        self.writer = tensorboard_writer(log_dir)
        return log_dir.name, str(log_dir)

    def _send(self, rows):
        tensorboard_steps(self.writer, rows)
        self.writer.flush()  # now, not after the writer's two minutes: this is what TensorBoard shows

    def _close(self, trained, finish):
        self.writer.close()


class _Wandb(_Channel):
    tracker = "wandb"

    def __init__(self, config: WandbTarget, folder: Path, *args):
        super().__init__(*args)
        self.config, self.folder, self.wandb_run = config, folder, None

    def _open(self, run_id):
        self.wandb_run = wandb_init(self.config, self.folder, self.name, self.tags, run_id)
        return self.wandb_run.id, wandb_url(self.wandb_run, self.config)

    def _send(self, rows):
        wandb_steps(self.wandb_run, rows)

    def _close(self, trained, finish):
        self.wandb_run.finish(exit_code=0 if trained else 1)


@dataclass
class _Attempt:
    """One training attempt's follower: a retry gets a new one, so a thread an earlier `stop` gave up on (still
    inside a slow send) keeps seeing its own stop event and abandoned flag and never writes again."""

    run_dir: Path
    stopping: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    trained: bool = False
    abandoned: bool = False
    thread: threading.Thread | None = None


class LiveTracker:
    """Follows one training run's `metrics.jsonl` to the trackers from a thread of its own: `start` when the run
    starts, `stop` when it has ended. Neither raises nor waits long (at most `STOP_WAIT_S`)."""

    def __init__(self, config: TrackConfig, work_dir: Path, finish: bool = False, end_runs: bool = False):
        self.config, self.work_dir, self.finish, self.end_runs = config, work_dir, finish, end_runs
        self._attempt: _Attempt | None = None

    def start(self, run_dir: Path) -> None:
        from sftflow.tasks.train.checkpoint import latest_checkpoint  # imports torch: not at the CLI's start

        # Taken here, in the calling task's context: the thread has none.
        self._logger = stage_logger("sftflow.track")
        self._tags = prefect_tags()
        attempt = _Attempt(Path(run_dir))
        # The worker resumes from the latest checkpoint (the stage resumes whenever there is one).
        latest = latest_checkpoint(attempt.run_dir / "checkpoints")
        trusted = int(latest.name.removeprefix("step-")) if latest is not None else 0
        tail = _MetricsTail(attempt.run_dir / "metrics.jsonl", trusted_through=trusted)
        attempt.thread = threading.Thread(target=self._follow, args=(attempt, tail), name="sftflow-live-track")
        attempt.thread.daemon = True
        self._attempt = attempt
        attempt.thread.start()

    def stop(self, trained: bool) -> None:
        attempt, self._attempt = self._attempt, None
        if attempt is None or attempt.thread is None:
            return
        attempt.trained = trained
        attempt.stopping.set()
        attempt.thread.join(STOP_WAIT_S)
        if attempt.thread.is_alive():
            with attempt.lock:
                attempt.abandoned = True  # its state is no longer written: the end-of-run send owns it now
            self._logger.warning(
                "track: the last live send did not finish within %.0f s; the run's end sends what it missed",
                STOP_WAIT_S,
            )

    def _follow(self, attempt: _Attempt, tail: _MetricsTail) -> None:
        try:
            channels = self._channels(attempt.run_dir)
            while True:
                stopping = attempt.stopping.is_set()
                records, replaced = tail.read()
                rows = step_rows(records)
                changed = [c.tick(rows, replaced, self._logger.warning) for c in channels]
                if any(changed):
                    self._save(attempt, channels)
                if stopping:  # that tick read what the finished run wrote last
                    break
                attempt.stopping.wait(self.config.live_every_s)
            for channel in channels:
                channel.close(attempt.trained, self.finish, self._logger.warning, end=self.end_runs)
            if attempt.trained and self.finish:
                self._save(attempt, channels)  # recorded closed: nothing will complete them
        except Exception as err:  # noqa: BLE001 -- live tracking never fails training; the run's end sends it
            self._logger.warning("track: live tracking stopped: %s: %s", type(err).__name__, err)

    def _channels(self, run_dir: Path) -> list[_Channel]:
        earlier = read_live_runs(run_dir)
        name = f"sftflow-{run_dir.name}"
        channels = []
        for tracker, target in self.config.targets(self.work_dir).items():
            before = earlier.get(tracker)
            if before is not None and before.target != target:
                before = None  # another target holds another run
            if before is not None and before.closed:
                continue  # complete: the end-of-run send decides what else it gets
            args = (target, name, self._tags, before)
            if tracker == "mlflow":
                channels.append(_MLflow(self.config.mlflow, *args))
            elif tracker == "tensorboard":
                channels.append(_TensorBoard(*args))
            else:
                channels.append(_Wandb(self.config.wandb, self.work_dir / "wandb", *args))
        return channels

    def _save(self, attempt: _Attempt, channels: list[_Channel]) -> None:
        with attempt.lock:
            if attempt.abandoned:
                return
            # Trackers not configured now keep their entries, as in `track.json`.
            runs = {**read_live_runs(attempt.run_dir), **{c.tracker: c.run for c in channels if c.run is not None}}
            write_live_runs(attempt.run_dir, runs)
