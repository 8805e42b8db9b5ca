"""moto's S3 server on a loopback port, counting what crosses the wire (for tests and benchmarks).

Counting at the server sees every request any client makes, retries included, and the bytes
really sent: the body bytes of each response and each request's declared length. A test can
also answer chosen requests itself (:attr:`CountingS3.intercept`) to play a failing or lying
server, and hold requests until several are in flight at once, to prove concurrency.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass
class Request:
    method: str
    path: str
    query: str
    status: int
    sent: int  # response body bytes
    received: int  # request body bytes (Content-Length)
    range: str


def _list_moto_modules_once() -> None:
    """moto lists its package folder (a stat of each of its ~180 services) for every request it
    dispatches: a fifth of the CPU of a test making a thousand requests. The folder does not
    change while the server runs, so list it once; what each request is answered stays moto's."""
    from moto import backends

    if not hasattr(backends, "_listed_once"):
        listed = tuple(backends.list_of_moto_modules())
        backends._listed_once = listed  # type: ignore[attr-defined]
        backends.list_of_moto_modules = lambda: iter(listed)  # type: ignore[assignment]


class CountingS3:
    """A moto S3 server on 127.0.0.1 whose every request is recorded in :attr:`requests`.

    ``endpoint`` is its URL; :meth:`environment` points botocore (and so s3fs, also for plain
    ``s3://`` URLs with no storage options) at it. :attr:`intercept`, when set, sees each
    request's WSGI environ first and may return ``(status, body)`` to answer it instead, or
    ``(status, body, headers)`` to add headers (a ``Content-Range`` a proxy mangled).
    """

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        _list_moto_modules_once()
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        self.requests: list[Request] = []
        self.intercept: Callable[[dict[str, Any]], tuple[Any, ...] | None] | None = None
        self.in_flight = 0
        self.most_in_flight = 0
        self._lock = threading.Lock()
        #: one lock per object name, held while moto writes it: S3 applies each write of an object
        #: whole, but moto's two PUTs of one name at once share a buffer one of them closes (a 500,
        #: "I/O operation on closed file", to one of two coordinators racing to write one index)
        self._writing: dict[str, threading.Lock] = {}
        self._moto = DomainDispatcherApplication(create_backend_app)
        self._serving = functools.partial(make_server, "127.0.0.1", port, self._app, threaded=True,
                                          request_handler=MotoRequestHandler)
        self._server = self._serving()
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> CountingS3:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join()

    def fail_once(self, method: str, name: str) -> threading.Event:
        """Answer the next ``method`` request for an object called ``name`` with a 500, once,
        as an S3 having a bad second does; the event is set once it has."""
        failed = threading.Event()

        def fail(environ: dict[str, Any]) -> tuple[Any, ...] | None:
            if environ["REQUEST_METHOD"] == method and environ["PATH_INFO"].endswith(f"/{name}") \
                    and not failed.is_set():
                failed.set()
                return 500, b"<Error><Code>InternalError</Code></Error>"
            return None

        self.intercept = fail
        return failed

    def kill(self, environ: dict[str, Any] | None = None) -> None:
        """Stop as a killed server does, keeping what it stores for :meth:`restart`: its port
        refuses connections and, given the WSGI ``environ`` of a request in flight (from
        :attr:`intercept`), that request's connection is reset unanswered (mid-upload, say)."""
        if environ is not None:
            connection = environ["werkzeug.socket"]
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
            connection.shutdown(socket.SHUT_RDWR)
        server, thread = self._server, self._thread  # this server's: restart() may replace them meanwhile
        server.socket.close()  # refused from now on, not left in the listening queue

        def stop() -> None:
            server.shutdown()
            thread.join()

        threading.Thread(target=stop, daemon=True).start()  # not on a request's thread, which it may be called on

    def restart(self) -> CountingS3:
        """Serve again on the same port, after :meth:`kill`, what was stored before it."""
        self._thread.join()
        self._server = self._serving()
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        return self.start()

    def environment(self) -> dict[str, str]:
        return {**CREDENTIALS, "AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_MAX_ATTEMPTS": "1"}

    def reset(self) -> None:
        with self._lock:
            self.requests = []
            self.most_in_flight = 0

    def count(self, method: str | None = None) -> int:
        return sum(1 for r in self.requests if method is None or r.method == method)

    def bytes_sent(self) -> int:
        return sum(r.sent for r in self.requests)

    def bytes_received(self) -> int:
        return sum(r.received for r in self.requests)

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterator[bytes]:
        with self._lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            status: list[int] = [0]

            def recording_start(line: str, headers: list[tuple[str, str]], *rest: Any) -> Any:
                status[0] = int(line.split()[0])
                return start_response(line, headers, *rest)

            answer = self.intercept(environ) if self.intercept else None
            if answer is not None:
                code, body, *added = answer
                recording_start(f"{code} X", [("Content-Length", str(len(body))), ("Content-Type", "application/xml"),
                                              *(added[0].items() if added else ())])
                chunks = [body]
            else:
                with self._object_written(environ):
                    chunks = list(self._moto(environ, recording_start))
        finally:
            with self._lock:
                self.in_flight -= 1
        request = Request(environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), environ.get("QUERY_STRING", ""),
                          status[0], sum(len(chunk) for chunk in chunks), int(environ.get("CONTENT_LENGTH") or 0),
                          environ.get("HTTP_RANGE", ""))
        with self._lock:
            self.requests.append(request)
        return iter(chunks)

    def _object_written(self, environ: dict[str, Any]) -> threading.Lock | contextlib.nullcontext[None]:
        """The lock of the object a request writes whole (a PUT, a multipart completion, a
        DELETE); none for reads and for the parts of an upload, which S3 takes at once."""
        method, query = environ["REQUEST_METHOD"], environ.get("QUERY_STRING", "")
        if method not in ("PUT", "POST", "DELETE") or "partNumber=" in query:
            return contextlib.nullcontext()
        with self._lock:
            return self._writing.setdefault(environ.get("PATH_INFO", ""), threading.Lock())


def use_environment(server: CountingS3 | ServerProcess) -> dict[str, str | None]:
    """Point this process's S3 clients at ``server``; returns what to restore."""
    saved = {key: os.environ.get(key) for key in server.environment()}
    os.environ.update(server.environment())
    return saved


def restore_environment(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


class ServerProcess:
    """A :class:`CountingS3` in a child process, so its Python work does not share this
    process's interpreter lock (a benchmark timing waits in this process must not time the
    server). It answers over its standard input: ``reset`` clears its record, ``counts``
    returns requests by method and the body bytes both ways; closing it stops the server."""

    def __init__(self) -> None:
        import subprocess
        import sys

        self._process = subprocess.Popen([sys.executable, "-m", "benchmarks.s3_server"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
        self.endpoint = self._answer()

    def _answer(self) -> str:
        assert self._process.stdout is not None
        line = self._process.stdout.readline().strip()
        if not line:
            raise RuntimeError("the S3 server process ended before answering")
        return line

    def _ask(self, command: str) -> str:
        assert self._process.stdin is not None
        self._process.stdin.write(command + "\n")
        self._process.stdin.flush()
        return self._answer()

    def environment(self) -> dict[str, str]:
        return {**CREDENTIALS, "AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_MAX_ATTEMPTS": "1"}

    def reset(self) -> None:
        self._ask("reset")

    def counts(self) -> dict[str, Any]:
        import json

        return json.loads(self._ask("counts"))

    def stop(self) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        self._process.wait(30)


def _serve() -> None:
    """The child side of :class:`ServerProcess`."""
    import json
    import sys

    server = CountingS3().start()
    print(server.endpoint, flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "reset":
            server.reset()
            print("ok", flush=True)
        elif command == "counts":
            with server._lock:
                requests = list(server.requests)
            by_method: dict[str, int] = {}
            for request in requests:
                by_method[request.method] = by_method.get(request.method, 0) + 1
            print(json.dumps({"requests": len(requests), "by_method": by_method,
                              "sent": sum(r.sent for r in requests), "received": sum(r.received for r in requests)}),
                  flush=True)
    server.stop()


if __name__ == "__main__":
    _serve()
