"""Headless Chromium (the Debian package), driven over the DevTools protocol: open a page,
evaluate JavaScript in it, take screenshots. Used to test the host element's status page as
a browser shows it.

    with Browser(workdir) as browser:
        browser.open("http://127.0.0.1:PORT/")
        browser.wait("document.querySelectorAll('tr').length > 2", 10, "rows")
        browser.screenshot(workdir / "page.png")
"""

import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request

import websocket  # python3-websocket

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


class BrowserError(Exception):
    pass


class Browser:
    def __init__(self, workdir, width=1280, height=900):
        self.profile = os.path.join(str(workdir), "chromium-profile")
        # Chromium's own temporary directories go inside the profile, removed with it (it is
        # killed, so it never cleans them up itself).
        self.tmp = os.path.join(self.profile, "tmp")
        os.makedirs(self.tmp, exist_ok=True)
        self.log_path = os.path.join(str(workdir), "chromium.log")
        self.log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",  # tests run as root
                "--disable-gpu",
                "--no-first-run",
                "--disable-extensions",
                "--disable-background-networking",
                "--disable-dev-shm-usage",
                f"--window-size={width},{height}",
                f"--user-data-dir={self.profile}",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                "about:blank",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, TMPDIR=self.tmp),
        )
        self.ids = itertools.count(1)
        self.socket = None
        try:
            self.socket = websocket.create_connection(self._page_socket(), timeout=30, suppress_origin=True)
        except BaseException:
            self.close()
            raise

    def _page_socket(self):
        """The DevTools WebSocket of the first page, once Chromium listens."""
        port_file = os.path.join(self.profile, "DevToolsActivePort")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BrowserError(f"chromium exited with {self.process.returncode}: {self._log_tail()}")
            try:
                with open(port_file) as f:
                    port = int(f.readline())
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                    targets = json.load(r)
                pages = [t for t in targets if t.get("type") == "page"]
                if pages:
                    return pages[0]["webSocketDebuggerUrl"]
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        raise BrowserError(f"chromium did not open its DevTools port in 30 s: {self._log_tail()}")

    def _log_tail(self):
        self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read()[-2000:].decode(errors="replace")

    def call(self, method, **params):
        """One DevTools command; its result (events in between are skipped)."""
        id = next(self.ids)
        self.socket.send(json.dumps({"id": id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv())
            if message.get("id") == id:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error']}")
                return message.get("result", {})

    def eval(self, expression):
        """The value of a JavaScript expression in the page (JSON-serialisable)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url, timeout=20):
        self.call("Page.enable")
        self.call("Page.navigate", url=url)
        self.wait("document.readyState === 'complete'", timeout, f"{url} to load")

    def wait(self, expression, timeout, what, interval=0.1):
        """Polls `expression` until it is truthy; its value. Fails after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = self.eval(expression)
            if value:
                return value
            time.sleep(interval)
        raise BrowserError(f"the page did not show {what} within {timeout} s (last: {value!r})")

    def viewport(self, width, height, mobile=False, scale=1):
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=scale,
                  mobile=mobile)

    def screenshot(self, path):
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
        return path

    def close(self):
        if self.socket is not None:
            try:
                self.socket.close()
            except OSError:
                pass
            self.socket = None
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)  # its own session: chromium and its helpers
            except ProcessLookupError:
                pass
            self.process.wait(timeout=10)
        self.log.close()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
