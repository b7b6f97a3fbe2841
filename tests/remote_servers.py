"""Real storage servers on 127.0.0.1, in threads of the test process (no process is spawned):
an S3 API (moto's, the one its server mode runs) and a range-capable HTTP server. Each counts,
on the server side, the requests it answered and the body bytes it sent, so the tests can hold
ckptfix to its planned-read claims the way a bucket's access log would.
"""

from __future__ import annotations

import email.utils
import hashlib
import http.server
import os
import re
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Environ = dict[str, Any]
StartResponse = Callable[..., Any]


def skip_without_s3() -> None:
    """Skip the calling test module when s3fs or moto's server is not installed -- found, not
    imported: importing them (about a second of CPU) is left to the test that starts a server, so
    the xdist worker that only collects the module does not pay for it."""
    import importlib.util

    import pytest

    for module, why in (("s3fs", "the [remote] extra (s3fs)"), ("moto", "moto[server]"), ("flask", "moto[server]")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the S3 tests need {why}: {module} is not installed", allow_module_level=True)


@dataclass
class Traffic:
    """What a server answered: one (method, path, Range header) per request, and body bytes sent."""

    requests: list[tuple[str, str, str]] = field(default_factory=list)
    bytes_sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: called with each request (method, path?query, range) before it is answered: a test's way
    #: to change the object mid-read, or to fail the request (return an HTTP status to answer)
    on_request: Callable[[str, str, str], int | None] | None = None

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.bytes_sent = 0

    def add(self, method: str, path: str, range_: str) -> int | None:
        with self.lock:
            self.requests.append((method, path, range_))
        return self.on_request(method, path, range_) if self.on_request is not None else None

    def sent(self, count: int) -> None:
        with self.lock:
            self.bytes_sent += count

    def to(self, key: str) -> list[tuple[str, str, str]]:
        """The requests that named ``key`` (an object's path)."""
        return [r for r in self.requests if r[1].split("?")[0].rstrip("/").endswith(key)]


class _Counting:
    """WSGI middleware: counts each request and every body byte the app sends back."""

    def __init__(self, app: Callable[[Environ, StartResponse], Iterable[bytes]], traffic: Traffic) -> None:
        self.app, self.traffic = app, traffic

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterator[bytes]:
        query = environ.get("QUERY_STRING", "")
        path = environ.get("PATH_INFO", "") + (f"?{query}" if query else "")
        status = self.traffic.add(environ["REQUEST_METHOD"], path, environ.get("HTTP_RANGE", ""))
        if status == DROP:  # the connection closes with no answer, as a network failure leaves it
            environ["werkzeug.socket"].shutdown(socket.SHUT_RDWR)
            return
        if status is not None:  # a fault the test asked for
            start_response(f"{status} Injected", [("Content-Type", "application/xml"), ("Content-Length", "0")])
            return
        body = self.app(environ, start_response)
        try:
            for chunk in body:
                self.traffic.sent(len(chunk))
                yield chunk
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()


@dataclass
class Server:
    endpoint: str
    traffic: Traffic
    stop: Callable[[], None]


def start_s3() -> Server:
    """moto's S3 API behind a counting middleware, served by werkzeug on a free loopback port."""
    from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    class Quiet(MotoRequestHandler):  # type: ignore[misc]
        def log_request(self, *args: Any) -> None:
            pass

    traffic = Traffic()
    app = _Counting(DomainDispatcherApplication(create_backend_app), traffic)
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=Quiet)
    # a short poll: shutdown() waits up to one poll interval (0.5 s by default)
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), name="moto-s3", daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        thread.join(5)

    return Server(f"http://127.0.0.1:{server.server_port}", traffic, stop)


_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")
#: what an ``on_request`` hook returns to make the HTTP server send a short body and drop the connection
SHORT_BODY = -1
#: what an ``on_request`` hook returns to make the S3 server drop the connection without answering
DROP = -2
#: ... to make the HTTP server send the bytes one further on than asked, as many, saying so in
#: its Content-Range (WRONG_RANGE) or claiming the range asked for (LYING_RANGE)
WRONG_RANGE = -3
LYING_RANGE = -4


def start_http(root: Path) -> Server:
    """A static file server for ``root`` that answers HEAD and single-range GETs (206) with an
    ETag of the file's size and mtime, as object stores and CDNs do."""
    traffic = Traffic()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _target(self) -> Path | None:
            path = (root / self.path.lstrip("/").split("?")[0]).resolve()
            return path if path.is_file() and root.resolve() in path.parents else None

        def _headers(self, path: Path) -> tuple[int, str]:
            st = path.stat()
            etag = hashlib.md5(f"{st.st_size}-{st.st_mtime_ns}".encode()).hexdigest()
            return st.st_size, f'"{etag}"'

        def do_HEAD(self) -> None:
            traffic.add("HEAD", self.path, "")
            path = self._target()
            if path is None:
                self.send_error(404)
                return
            size, etag = self._headers(path)
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.send_header("ETag", etag)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Last-Modified", email.utils.formatdate(path.stat().st_mtime, usegmt=True))
            self.end_headers()

        def do_GET(self) -> None:
            range_ = self.headers.get("Range", "")
            fault = traffic.add("GET", self.path, range_)
            if fault == SHORT_BODY:  # the headers promise more than is sent, then the connection drops
                self.send_response(206)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                self.wfile.write(b"x" * 10)
                self.close_connection = True
                return
            if fault is not None and fault not in (WRONG_RANGE, LYING_RANGE):
                self.send_response(fault)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            path = self._target()
            if path is None:
                self.send_error(404)
                return
            size, etag = self._headers(path)
            start, end = 0, size
            match = _RANGE.match(range_)
            if match:
                start = int(match.group(1))
                end = min(size, int(match.group(2)) + 1) if match.group(2) else size
                if start >= size or start >= end:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206)
                said = f"bytes {start}-{end - 1}/{size}"
                if fault in (WRONG_RANGE, LYING_RANGE):  # the bytes one further on (or back), as many
                    shift = 1 if end < size else -1
                    start, end = start + shift, end + shift
                    said = f"bytes {start}-{end - 1}/{size}" if fault == WRONG_RANGE else said
                self.send_header("Content-Range", said)
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(end - start))
            self.send_header("ETag", etag)
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            with open(path, "rb") as f:
                done = start
                while done < end:
                    chunk = os.pread(f.fileno(), min(1 << 20, end - done), done)
                    if not chunk:
                        break
                    self.wfile.write(chunk)
                    traffic.sent(len(chunk))
                    done += len(chunk)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), name="http-range", daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return Server(f"http://127.0.0.1:{server.server_address[1]}", traffic, stop)
