"""Open a page in a real headless Chromium over the DevTools protocol and report what it saw.

Collects console errors (`console.error`, uncaught exceptions, browser log entries of level
error, such as a failed resource load) and every image's natural size after decoding, so a test
can assert that a report loads cleanly and shows every plot.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import websocket

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--remote-debugging-port=0",
]
IMAGES_JS = """
(async () => {
  const imgs = Array.from(document.images);
  await Promise.all(imgs.map(i => i.decode().catch(() => null)));
  return JSON.stringify(imgs.map(i => ({alt: i.alt, complete: i.complete, w: i.naturalWidth, h: i.naturalHeight})));
})()
"""


def chromium_binary() -> str | None:
    """Debian's `chromium` (installed by tests/setup-system.sh), if present."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class PageReport:
    """What the browser saw on one page."""

    errors: list[str] = field(default_factory=list)
    images: list[dict[str, Any]] = field(default_factory=list)
    text: str = ""


class DevToolsPage:
    """One page target of a headless Chromium this object starts and stops."""

    def __init__(self, user_data_dir: Path, timeout: float = 60.0) -> None:
        binary = chromium_binary()
        if binary is None:
            raise RuntimeError("chromium is not installed (run tests/setup-system.sh)")
        self.timeout = timeout
        self.proc = subprocess.Popen(
            [binary, *CHROMIUM_FLAGS, f"--user-data-dir={user_data_dir}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        port = self._devtools_port()
        page = self._page_target(port)
        self.ws = websocket.create_connection(page, timeout=timeout, suppress_origin=True)
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def _devtools_port(self) -> int:
        assert self.proc.stderr is not None
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode} before DevTools was up")
            m = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
            if m:
                return int(m.group(1))
        raise RuntimeError("chromium did not announce its DevTools port in time")

    def _page_target(self, port: int) -> str:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as resp:
                targets = json.load(resp)
            pages = [t for t in targets if t.get("type") == "page"]
            if pages:
                return str(pages[0]["webSocketDebuggerUrl"])
            time.sleep(0.1)
        raise RuntimeError("no page target")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command and wait for its answer, keeping the events that arrive meanwhile."""
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))
            self.events.append(msg)

    def wait_for(self, event: str) -> None:
        """Read events until `event` arrives."""
        if any(e.get("method") == event for e in self.events):
            return
        while True:
            msg = json.loads(self.ws.recv())
            self.events.append(msg)
            if msg.get("method") == event:
                return

    def open(self, path: Path) -> PageReport:
        """Load a file, wait for it and its images, and report errors, images and text."""
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")
        self.events.clear()
        self.call("Page.navigate", url=path.resolve().as_uri())
        self.wait_for("Page.loadEventFired")
        images = self.call("Runtime.evaluate", expression=IMAGES_JS, awaitPromise=True, returnByValue=True)
        text = self.call("Runtime.evaluate", expression="document.body.innerText", returnByValue=True)
        self.call("Runtime.evaluate", expression="0")  # flush events queued before this point
        report = PageReport(images=json.loads(images["result"]["value"]), text=str(text["result"]["value"]))
        for e in self.events:
            method, params = e.get("method"), e.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                report.errors.append(" ".join(str(a.get("value", a.get("description"))) for a in params["args"]))
            elif method == "Runtime.exceptionThrown":
                report.errors.append(str(params["exceptionDetails"].get("text")))
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                report.errors.append(str(params["entry"].get("text")))
        return report

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited, returned by value)."""
        reply = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in reply:
            raise RuntimeError(f"evaluate: {reply['exceptionDetails'].get('text')}")
        return reply["result"].get("value")

    def set_window(self, width: int, height: int) -> None:
        """Make the page's viewport `width` x `height` CSS pixels (a desktop window, scale 1)."""
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def screenshot(self, path: Path) -> Path:
        """Save what the viewport shows now (the first screen) as a PNG."""
        shot = self.call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def close(self) -> None:
        """Close the connection and stop the browser this object started."""
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            if self.proc.stderr is not None:
                self.proc.stderr.close()

    def __enter__(self) -> DevToolsPage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
