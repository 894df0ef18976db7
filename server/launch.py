"""Process start-up: bind the HTTP port, start the engine process, serve, clean up.

Order: bind and listen on ``--host:--port`` first (a port in use is a clear error before the
engine is spawned) -> private temp dir with the two ``ipc://`` sockets -> engine process
(spawn context) running ``engine.worker.run_engine(engine_args, input_addr, output_addr)`` ->
uvicorn on the bound socket (the app finishes start-up in the background, see ``server.app``)
-> on exit, stop the engine process (SIGTERM, then SIGKILL after 5 s) and remove the temp dir.

Multi-node (``--nnodes N --node-rank k``, SGLang's layout): node 0 does all of the above; a
node k > 0 binds no port and runs no HTTP server or tokenizer, only its engine process (the
leader of TP ranks ``k * tp_size // N ..``), and waits for it: it exits 0 when node 0 stops the
deployment and 1 when the deployment breaks (see ``run_node``).
"""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
from typing import Any, Callable

import uvicorn

from server.app import ServerStatus, create_app
from server.args import ServerArgs
from server.engine_client import EngineClient

logger = logging.getLogger("server")

LOG_FORMAT = "[%(asctime)s] %(levelname)s %(name)s: %(message)s"


class PortInUseError(RuntimeError):
    """The HTTP port is already taken (or cannot be bound)."""


def setup_logging(level: str) -> None:
    """Plain one-line logs on stderr for the server and uvicorn."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, datefmt="%Y-%m-%d %H:%M:%S",
                        stream=sys.stderr, force=True)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``. Raises ``PortInUseError`` with a clear
    message if the address is taken or cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUseError(f"port {port} on {host} is already in use; stop the other "
                                 f"server or pass --port") from None
        raise PortInUseError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def stop_process(proc: Any, timeout: float = 5.0) -> None:
    """Terminate a ``multiprocessing.Process`` (SIGTERM, then SIGKILL after ``timeout`` s)."""
    if proc is None or proc.pid is None:
        return
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout)


class _Server(uvicorn.Server):
    """uvicorn server that reports the start of a shutdown (SIGINT/SIGTERM) at once, so
    ``/health_generate`` turns 503 before in-flight requests have drained."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


def default_engine_target() -> Callable[..., Any]:
    from engine.worker import run_engine

    return run_engine


def run_node(args: ServerArgs, engine_target: Callable[..., Any] | None = None) -> int:
    """A node k > 0 of a multi-node deployment: start the engine process (no ZMQ addresses,
    no HTTP) and block until it exits. Returns 0 when node 0 stopped the deployment, 1 when
    the engine failed (start-up error, lost node, dead rank). SIGINT/SIGTERM (as
    KeyboardInterrupt) stop the engine, which breaks the deployment: node 0 then answers 503."""
    eng = args.engine
    per_node = eng.tp_size // eng.nnodes
    first = eng.node_rank * per_node
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=engine_target or default_engine_target(), args=(eng, None, None),
                       kwargs={"log_level": args.log_level}, name="eyrie-engine")
    try:
        proc.start()
        logger.info("node %d of %d: engine process %d runs TP ranks %d..%d; no HTTP server on "
                    "this node (node 0 serves the API); joining %s", eng.node_rank, eng.nnodes,
                    proc.pid, first, first + per_node - 1, eng.dist_init_addr)
        proc.join()
    finally:
        stop_process(proc)
    if proc.exitcode == 0:
        logger.info("the deployment ended; node %d stopped", eng.node_rank)
        return 0
    logger.error("engine process exited with code %s; node %d stopped", proc.exitcode,
                 eng.node_rank)
    return 1


def run_server(args: ServerArgs, engine_target: Callable[..., Any] | None = None) -> int:
    """Run the server until SIGINT/SIGTERM or a start-up failure. Returns the exit code
    (0 normal shutdown, 1 start-up failure, 2 port in use). On a node k > 0 of a multi-node
    deployment this is ``run_node`` (no HTTP)."""
    setup_logging(args.log_level)
    if args.engine.node_rank > 0:
        return run_node(args, engine_target)
    try:
        sock = bind_socket(args.host, args.port)
    except PortInUseError as e:
        logger.error("error: %s", e)
        return 2
    ipc_dir = tempfile.mkdtemp(prefix="eyrie-ipc-")
    os.chmod(ipc_dir, 0o700)
    input_addr = f"ipc://{os.path.join(ipc_dir, 'engine-in')}"
    output_addr = f"ipc://{os.path.join(ipc_dir, 'engine-out')}"
    proc = None
    exit_code = [0]
    server: uvicorn.Server | None = None
    try:
        client = EngineClient(input_addr, output_addr)
        logger.info("starting the engine process for %s", args.engine.model_path)
        ctx = multiprocessing.get_context("spawn")
        proc = ctx.Process(target=engine_target or default_engine_target(),
                           args=(args.engine, input_addr, output_addr),
                           kwargs={"log_level": args.log_level}, name="eyrie-engine")
        proc.start()
        client.attach_process(proc)
        logger.info("engine process started (pid %d)", proc.pid)

        def request_shutdown(code: int) -> None:
            exit_code[0] = code
            if server is not None:
                server.should_exit = True

        app = create_app(args, client, request_shutdown)
        config = uvicorn.Config(app, loop="uvloop", timeout_keep_alive=5, log_config=None,
                                log_level=args.log_level, access_log=False, lifespan="on",
                                timeout_graceful_shutdown=5)
        state = app.state.eyrie

        def on_exit() -> None:
            # probes answer 503 from now on; running requests end (finish reason abort) so
            # streams close cleanly instead of being cut at the graceful-shutdown timeout
            state.status = ServerStatus.SHUTTING_DOWN
            client.abort(abort_all=True)

        server = _Server(config, on_exit=on_exit)
        logger.info("HTTP server listening on http://%s:%d (starting up)", args.host,
                    args.port)
        server.run(sockets=[sock])
    finally:
        stop_process(proc)
        sock.close()
        shutil.rmtree(ipc_dir, ignore_errors=True)
        logger.info("server stopped")
    return exit_code[0]


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """``python -m server`` entry point."""
    from server.args import parse_args

    try:
        args = parse_args(argv)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    # SIGTERM should run the same clean shutdown as Ctrl-C (uvicorn installs both handlers
    # while serving; this covers the short window before it does).
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return run_server(args)
    except KeyboardInterrupt:
        return 0
