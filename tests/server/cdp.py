"""A minimal Chrome DevTools Protocol client over --remote-debugging-pipe (file descriptors
3 and 4, NUL-separated JSON), so a test can drive headless Chromium without extra packages."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from typing import Any

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


class Browser:
    def __init__(self, executable: str, profile: str):
        to_r, self._to = os.pipe()
        self._from, from_w = os.pipe()

        def child_fds() -> None:  # the browser reads commands on fd 3 and answers on fd 4
            a, b = os.dup(to_r), os.dup(from_w)  # first out of the way of 3 and 4
            os.dup2(a, 3)  # dup2 makes them inheritable; close_fds=False keeps them open
            os.dup2(b, 4)

        args = [executable, "--headless=new", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe"]
        args += [f"--user-data-dir={profile}", "--no-first-run", "--window-size=1200,900", "about:blank"]
        self.proc = subprocess.Popen(
            args, preexec_fn=child_fds, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        os.close(to_r)
        os.close(from_w)
        self._buffer = b""
        self._id = 0
        self.session: str | None = None
        self.events: list[dict[str, Any]] = []  # what the browser told us on its own (method, params)

    def send(self, method: str, params: dict | None = None, *, browser_level: bool = False) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if self.session and not browser_level:
            msg["sessionId"] = self.session
        os.write(self._to, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if "method" in reply and "id" not in reply:
                self.events.append(reply)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def _read(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            chunk = os.read(self._from, 1 << 16)
            if not chunk:
                raise EOFError("the browser closed its pipe")
            self._buffer += chunk
        msg, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(msg)

    def open(self, url: str) -> None:
        target = self.send("Target.createTarget", {"url": url}, browser_level=True)["targetId"]
        attach = {"targetId": target, "flatten": True}
        self.session = self.send("Target.attachToTarget", attach, browser_level=True)["sessionId"]
        self.wait_for(f"location.href === {json.dumps(url)} && document.readyState === 'complete'")

    def js(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.js(expression):
                    return
            except RuntimeError:  # e.g. the page was navigating: its context went away
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(expression)
            time.sleep(0.05)

    def close(self) -> None:
        try:
            self.send("Browser.close", browser_level=True)
        except (OSError, EOFError, RuntimeError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to)
        os.close(self._from)
