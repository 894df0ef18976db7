"""Fixtures for end-to-end tests (see ``harness.py``): every server a module starts is killed,
with its engine process, at module teardown, even when a test failed."""

from __future__ import annotations

import pytest

from harness import STORIES, ServerProcess


@pytest.fixture(scope="module")
def launch():
    """Factory fixture: ``launch(args, wait=True)`` starts a server; all are killed at module
    teardown, whatever happened."""
    servers: list[ServerProcess] = []

    def _launch(args: list[str], wait: bool = True) -> ServerProcess:
        srv = ServerProcess(args)
        servers.append(srv)
        if wait:
            srv.wait_ready()
        return srv

    yield _launch
    for srv in servers:
        srv.kill()


@pytest.fixture(scope="module")
def stories_server(launch) -> ServerProcess:
    """One stories260K server shared by a module's tests."""
    return launch(["--model-path", STORIES])
