"""Run the gateway app with uvicorn on a background thread.

The gateway lives inside a process that already has its own threads and event loops (a
rollout runner, a test), so the server gets a thread and a loop of its own and never touches
signal handlers, which belong to whoever owns the main thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

log = logging.getLogger(__name__)


class _ThreadServer(uvicorn.Server):
    """A uvicorn server that leaves process signals alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class GatewayServer:
    """One uvicorn server on a daemon thread; ``start`` returns once it accepts connections."""

    def __init__(self) -> None:
        self._server: _ThreadServer | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._url: str | None = None
        self._failure: BaseException | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("gateway server is not running")
        return self._url

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(
        self, app: Any, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 10.0
    ) -> str:
        """Bind ``host:port`` (0 picks a free port) and serve ``app``; return the base URL."""
        if self._thread is not None:
            raise RuntimeError(f"gateway server already started at {self._url}")
        # Binding here, not in uvicorn, is what lets port 0 report the port it got.
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
        except OSError:
            sock.close()
            raise
        bound_port = sock.getsockname()[1]
        config = uvicorn.Config(
            app, host=host, port=bound_port, log_level="warning", lifespan="off"
        )
        server = _ThreadServer(config)
        self._server, self._sock, self._failure = server, sock, None
        thread = threading.Thread(
            target=self._serve, args=(server, sock), name=f"gateway-{bound_port}", daemon=True
        )
        self._thread = thread
        thread.start()
        deadline = time.monotonic() + startup_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                failure = self._failure
                self.stop(timeout=1.0)
                raise RuntimeError(f"gateway server did not start on {host}:{bound_port}") from (
                    failure
                )
            time.sleep(0.005)
        shown = f"[{host}]" if ":" in host else host
        self._url = f"http://{shown}:{bound_port}"
        return self._url

    def _serve(self, server: _ThreadServer, sock: socket.socket) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(server.serve(sockets=[sock]))
        except BaseException as e:  # uvicorn reports a failed startup as SystemExit
            self._failure = e
            log.exception("gateway server stopped with an error")
        finally:
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            asyncio.set_event_loop(None)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving, let open requests finish for up to ``timeout`` seconds, release the
        port. Safe to call twice."""
        server, thread, sock = self._server, self._thread, self._sock
        if server is not None:
            server.config.timeout_graceful_shutdown = max(1, int(timeout))
            server.should_exit = True
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive() and server is not None:
                server.force_exit = True
                thread.join(1.0)
            if thread.is_alive():
                log.warning("gateway server thread %s did not stop in time", thread.name)
        if sock is not None:
            sock.close()
        self._server = self._thread = self._sock = None
        self._url = None
