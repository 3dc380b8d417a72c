"""A local S3 server (moto) for tests and checks, with S3's atomic conditional writes.

Real S3 answers a PUT with `If-None-Match: *` atomically: of two at once, one creates the key
and the other gets 412. Moto checks and then writes, so two at once can both succeed, and the
ownership log (data_plane/ownership.py), whose claims are create-only writes, would show two
owners of one slot: a failure of the stand-in, not of the code under test. This server handles
conditional PUTs one at a time, as S3 does; every other request as moto does."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from moto.moto_server.threaded_moto_server import ThreadedMotoServer
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import make_server


class _AtomicConditionalPuts:
    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app, self.lock = app, threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") == "PUT" and environ.get("HTTP_IF_NONE_MATCH"):
            with self.lock:
                return list(self.app(environ, start_response))
        return self.app(environ, start_response)


class S3Server(ThreadedMotoServer):
    """`ThreadedMotoServer` whose conditional PUTs are atomic."""

    def _server_entry(self) -> None:
        app = _AtomicConditionalPuts(DomainDispatcherApplication(create_backend_app))
        self._server = make_server(self._ip_address, self._port, app, True,
                                   request_handler=MotoRequestHandler)  # fmt: skip
        self._server_ready_event.set()
        self._server.serve_forever()
