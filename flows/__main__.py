"""`python -m sftflow.flows ...`: the `sftflow` command, where its console script is not installed (a bare GPU image
with the sources on PYTHONPATH)."""

from sftflow.flows.cli import app

app(prog_name="sftflow")
