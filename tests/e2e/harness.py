"""Harness for end-to-end tests: a real ``python -m server`` process on a free loopback port.

Each server runs in its own process group (``start_new_session``), so teardown kills the API
process, the engine process and anything they spawned, even when a test failed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
STORIES = str(REPO / "tests" / "fixtures" / "stories260K")
STARTUP_TIMEOUT_S = 300.0  # SmolLM2 start-up on a busy 2-core machine can take a minute or two


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_in_background(url: str, body: dict, timeout: float
                       ) -> tuple[threading.Thread, list[int]]:
    """POST ``body`` to ``url`` from a started thread; its status code lands in the list."""
    results: list[int] = []
    thread = threading.Thread(target=lambda: results.append(
        httpx.post(url, json=body, timeout=timeout).status_code))
    thread.start()
    return thread, results


def run_on_taken_port(extra: list[str]) -> tuple[subprocess.CompletedProcess, int]:
    """Run ``python -m server --model-path STORIES --port P *extra`` to completion while P is
    held by a listening socket; returns (the finished process, P)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "server", "--model-path", STORIES, "--port",
                            str(port), *extra], cwd=REPO, capture_output=True, text=True,
                           timeout=120)
    return r, port


class ServerProcess:
    """A running ``python -m server``; ``url`` is its base URL, ``log()`` its output so far."""

    def __init__(self, args: list[str], port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="eyrie-e2e-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "server", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Poll ``/health_generate`` until 200. Fails with the server log on exit/timeout."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log()[-5000:]}")
            try:
                if httpx.get(self.url + "/health_generate", timeout=30).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        pytest.fail(f"server not ready after {timeout} s:\n{self.log()[-5000:]}")

    def engine_pid(self) -> int:
        return httpx.get(self.url + "/server_info", timeout=30).json()["engine_pid"]

    def kill(self) -> None:
        """SIGTERM the whole process group, then SIGKILL whatever is left after 10 s. The
        group id is the server's pid (``start_new_session``), so this also reaches children
        left behind after the server process itself has exited."""
        pgid = self.proc.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        self._log.close()
        os.unlink(self._log.name)
