"""Serve every sftflow deployment from this process, without a work pool.

    prefect server start                      # in another terminal (or use Prefect Cloud)
    prefect config set PREFECT_API_URL=http://127.0.0.1:4200/api    # once: point this profile at that server
    python deployments/serve.py               # registers and serves the deployments below
    prefect deployment run sft/full --watch

`SFTFLOW_CONFIG` picks the config file the deployments use by default (default: deployments/configs/demo.yaml);
any run can pass another with `-p config_path=...`, and set any config field with
`-p overrides='{"train.optimizer.lr": 1e-5}'` (dotted keys, as `sftflow --set` takes them). `SFTFLOW_REFRESH_CRON`
sets the data refresh schedule; `SFTFLOW_REFRESH_THEN=promote` (or `train`) moves it onto `sft-refresh/chain`, which
trains, evaluates and runs the promotion gate on the nights the data changed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from prefect import serve

from sftflow.flows.bench import sft_bench
from sftflow.flows.check import sft_check
from sftflow.flows.data import sft_data
from sftflow.flows.eval import sft_eval
from sftflow.flows.plan import sft_plan
from sftflow.flows.promote import sft_promote
from sftflow.flows.refresh import sft_refresh
from sftflow.flows.sft import sft
from sftflow.flows.train import sft_train

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "configs" / "demo.yaml"


def deployments(config_path: str, refresh_cron: str = "0 3 * * *", refresh_then: str | None = None):
    """`refresh_then` ("train" or "promote") puts the refresh schedule on `sft-refresh/chain` instead of on
    `sft-data/refresh`: one schedule, so the two never race for the work folder."""
    params = {"config_path": config_path}
    chain_then = refresh_then or "promote"
    return [
        sft.to_deployment(name="full", parameters=params, description="The whole pipeline: data → plan → train → eval"),
        sft_data.to_deployment(
            name="refresh",
            parameters=params,
            cron=None if refresh_then else refresh_cron,
            description="Re-render and re-index when the sources changed; a cached no-op when they did not",
        ),
        sft_refresh.to_deployment(
            name="chain",
            parameters=params | {"then": chain_then},
            cron=refresh_cron if refresh_then else None,
            description="Refresh the data; when it changed, train, evaluate and run the promotion gate",
        ),
        sft_plan.to_deployment(name="rerun", parameters=params, description="Re-plan from the latest data result"),
        sft_train.to_deployment(name="rerun", parameters=params, description="Rerun (or resume) training alone"),
        sft_eval.to_deployment(name="rerun", parameters=params, description="Re-evaluate the latest trained model"),
        sft_bench.to_deployment(
            name="rerun", parameters=params, description="Re-score the latest trained model on the benchmark tasks"
        ),
        sft.to_deployment(
            name="promote",
            parameters=params | {"promote": True},
            description="The whole pipeline, then the promotion gate: the new model replaces the champion if it wins",
        ),
        sft_promote.to_deployment(
            name="gate", parameters=params, description="Promote the latest trained model if it beats the champion"
        ),
        sft_check.to_deployment(
            name="gate",
            parameters=params,
            description="Check the data's tokens and masks and the first training steps against Hugging Face; "
            "fails when a check fails, so it can gate training",
        ),
    ]


def api_unset_reason() -> str | None:
    """Why serving here would be useless, or None: without `PREFECT_API_URL` (environment or profile), `serve`
    starts a temporary server of its own, which `prefect deployment run` (another process) never reaches."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return None
    return (
        "serve.py: PREFECT_API_URL is not set, so the deployments would be served on a temporary server that "
        "`prefect deployment run` cannot reach; with `prefect server start` running, run `prefect config set "
        "PREFECT_API_URL=http://127.0.0.1:4200/api` (or export it in this shell) and start serve.py again"
    )


if __name__ == "__main__":
    if (reason := api_unset_reason()) is not None:
        print(f"error: {reason}", file=sys.stderr)
        raise SystemExit(2)
    config = os.environ.get("SFTFLOW_CONFIG", str(DEFAULT_CONFIG))
    cron = os.environ.get("SFTFLOW_REFRESH_CRON", "0 3 * * *")
    then = os.environ.get("SFTFLOW_REFRESH_THEN") or None
    if then not in (None, "train", "promote"):
        raise SystemExit(f"SFTFLOW_REFRESH_THEN={then!r}: expected 'train' or 'promote' (or unset)")
    serve(*deployments(config, cron, then))
