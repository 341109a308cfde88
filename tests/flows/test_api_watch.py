"""The API watch against real sockets: a port nobody listens on is lost, any HTTP answer is not.

The whole path (a real `prefect server` killed under `sftflow run`) is `tests/deployments/test_lifecycle.py`.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sftflow.flows.api_watch import APIWatch, lost_timeout_s, probe
from sftflow.flows.local_api import free_port


class _NotFound(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def answering_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/api"
    server.shutdown()
    server.server_close()


def test_any_http_answer_is_reachable_and_a_closed_port_is_not(answering_url):
    assert probe(answering_url) is None
    reason = probe(f"http://127.0.0.1:{free_port()}/api")
    assert reason is not None and reason.startswith("ConnectError")


def test_the_watch_reports_a_lost_api_once_and_a_live_one_never(answering_url):
    lost: list[str] = []
    told = threading.Event()

    def on_lost(reason: str) -> None:
        lost.append(reason)
        told.set()

    dead = APIWatch(f"http://127.0.0.1:{free_port()}/api", 0.5, on_lost).start()
    assert told.wait(30)
    dead.stop()
    assert len(lost) == 1 and lost[0].startswith("ConnectError")
    live = APIWatch(answering_url, 0.5, lambda reason: lost.append(reason)).start()
    threading.Event().wait(3)  # several probes, each answered
    live.stop()
    assert len(lost) == 1


def test_a_bad_timeout_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv("SFTFLOW_API_LOST_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SFTFLOW_API_LOST_TIMEOUT='soon': expected a number of seconds"):
        lost_timeout_s()
