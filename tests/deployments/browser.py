"""Headless Chromium, driven over the DevTools protocol: open a flow run's page in Prefect's UI, click its Artifacts
tab, open each artifact, report what rendered and take screenshots.

    python tests/deployments/browser.py http://127.0.0.1:4200 <flow-run-id> screenshots/

Chromium is Debian's `chromium` package (`apt-get install -y chromium`); `chromium_path()` is None without it. The
protocol is JSON over a websocket (the `websockets` package, which Prefect depends on).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)

# What a page shows: its text, each image's decoded width (0 for an image that did not load) and each table's cells.
_REPORT_JS = """JSON.stringify({
  text: document.body.innerText,
  images: [...document.querySelectorAll('.artifact-data-image img, .markdown-renderer img')]
    .map(img => ({width: img.naturalWidth, src: img.src.slice(0, 40)})),
  tables: [...document.querySelectorAll('table')].map(t => t.innerText),
})"""

_CLICK_TAB_JS = """(() => {
  const tab = [...document.querySelectorAll('[role=tablist] .p-tab')].find(b => b.innerText.trim() === %s);
  if (!tab) return false;
  tab.click();
  return true;
})()"""

# The tab lists the flow run's own artifacts first, then its task runs': the cards of the first group, as
# [title, href] pairs, once the tab has loaded them.
_RUN_CARDS_JS = """(() => {
  const group = document.querySelector('#artifacts-content .row-grid-layout-list');
  if (!group) return null;
  const cards = [...group.querySelectorAll('a')]
    .map(a => [a.querySelector('.artifact-card__title')?.innerText, a.href]);
  return cards.length ? JSON.stringify(cards) : null;
})()"""

# An artifact's page has rendered its data (the "Show raw data" button follows it) and every image settled.
_ARTIFACT_SHOWN_JS = "document.body.innerText.includes('Show raw data') && [...document.images].every(i => i.complete)"


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class _Page:
    def __init__(self, socket):
        self.socket, self.ids = socket, itertools.count(1)

    async def call(self, method: str, **params) -> dict:
        call_id = next(self.ids)
        await self.socket.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(await self.socket.recv())
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    async def evaluate(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = await self.evaluate(expression)
            if value:
                return value
            await asyncio.sleep(0.5)
        raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")


async def _show(ws_url: str, run_url: str, out_dir: Path, timeout_s: float) -> dict:
    import websockets

    async with websockets.connect(ws_url, max_size=64 * 2**20) as socket:
        page = _Page(socket)
        size = dict(width=1400, height=1400, deviceScaleFactor=1, mobile=False)
        await page.call("Emulation.setDeviceMetricsOverride", **size)

        async def screenshot(name: str) -> None:
            await asyncio.sleep(1.0)  # let the layout settle
            shot = await page.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
            (out_dir / name).write_bytes(base64.b64decode(shot["data"]))

        await page.call("Page.navigate", url=run_url)
        await page.wait_for(_CLICK_TAB_JS % json.dumps("Artifacts"), timeout_s, "the run page's Artifacts tab")
        cards = json.loads(await page.wait_for(_RUN_CARDS_JS, timeout_s, "the flow run's artifact cards"))
        await screenshot("run-artifacts.png")
        shown = {"cards": [title for title, _ in cards], "artifacts": {}}
        for title, href in cards:
            await page.call("Page.navigate", url=href)
            await page.wait_for(_ARTIFACT_SHOWN_JS, timeout_s, f"artifact {title} to render")
            await screenshot(f"artifact-{title}.png")
            shown["artifacts"][title] = json.loads(await page.evaluate(_REPORT_JS))
        return shown


def show_run_artifacts(ui_url: str, flow_run_id: str, out_dir: Path, timeout_s: float = 90) -> dict:
    """Open the flow run's page in Prefect's UI, click Artifacts and screenshot it (`run-artifacts.png`), then open
    each artifact of the run itself and screenshot it (`artifact-<key>.png`). Returns `cards` (the keys the tab
    lists) and, per key, what its page shows: `text`, `images` (with their decoded `width`) and `tables`."""
    browser = chromium_path()
    if browser is None:
        raise FileNotFoundError("chromium is not installed (apt-get install -y chromium)")
    out_dir.mkdir(parents=True, exist_ok=True)
    # Chromium's helper processes may still write into the profile for a moment after the group is killed.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        proc = subprocess.Popen(
            [browser, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # so that its helper processes go with it
        )
        try:
            port_file = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + timeout_s
            while not port_file.is_file() or not port_file.read_text().strip():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"chromium did not start (exit code {proc.poll()})")
                time.sleep(0.2)
            port = port_file.read_text().split()[0]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                ws_url = next(t["webSocketDebuggerUrl"] for t in json.load(r) if t["type"] == "page")
            run_url = f"{ui_url.rstrip('/')}/runs/flow-run/{flow_run_id}"
            return asyncio.run(_show(ws_url, run_url, out_dir, timeout_s))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


if __name__ == "__main__":
    shown = show_run_artifacts(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
    for artifact in shown["artifacts"].values():
        artifact.pop("text")
    print(json.dumps(shown, indent=2))
