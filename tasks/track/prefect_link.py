"""The Prefect flow run a tracker run links back to: its id, name and UI address, as tags. Read by live tracking
(when training starts) and by the track stage (when the run is sent)."""

from __future__ import annotations


def prefect_tags() -> dict[str, str]:
    """The current Prefect flow run, for the tracker to link back to."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return {}
    from prefect.runtime import flow_run

    tags = {"prefect.flow_run_id": str(context.flow_run.id), "prefect.flow_run_name": context.flow_run.name}
    url = flow_run.ui_url  # None when no UI URL is configured
    if url:
        tags["prefect.flow_run_url"] = str(url)
    return tags
