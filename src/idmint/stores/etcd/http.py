"""A lean HTTP/1.1 client for JSON POSTs to a store's gateway (etcd's): kept-alive connections
from the standard library, a handful of function calls per request.

httpx spent about a millisecond of CPU on each etcd call (some 1,900 Python calls in its
layers): with ten processes on one machine, that CPU, not etcd, was the ceiling. What this
keeps from it is what the callers rely on: a request that could not be connected was not
sent (another endpoint may take it), one that was sent and got no answer may have been
applied (it must not be sent elsewhere).
"""

from __future__ import annotations

import http.client
import socket
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..._poll import readable


class NotSent(Exception):
    """No connection could be made: the request was not sent."""


class NoAnswer(Exception):
    """The request was sent (or may have been), and no whole answer came: it may have been
    applied."""


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    date: str | None  # the Date header: the server's clock


class Connections:
    """Idle kept-alive connections per endpoint ("host:port"), shared by threads: a thread
    takes one for a request and puts it back after a whole answer. Thread-safe."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._idle: dict[str, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self.closed = False

    def post(self, endpoint: str, path: str, body: bytes) -> Answer:
        """POST `body` (JSON) to http://endpoint/path. Raises NotSent or NoAnswer."""
        conn = self._take(endpoint)
        if conn is None:
            where = urlsplit(f"//{endpoint}")  # "[::1]:2379" too
            host = where.hostname or endpoint
            conn = http.client.HTTPConnection(host, where.port, timeout=self.timeout)
            try:
                conn.connect()
            except TimeoutError:
                conn.close()
                raise NotSent(f"{endpoint}: no connection within {self.timeout:g} s") from None
            except OSError as exc:
                conn.close()
                raise NotSent(f"{endpoint}: {exc.strerror or exc}") from None
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
        except TimeoutError:
            conn.close()
            raise NoAnswer(f"{endpoint}: no answer within {self.timeout:g} s") from None
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise NoAnswer(f"{endpoint}: {type(exc).__name__} {exc}".strip()) from None
        if response.will_close:
            conn.close()
        else:
            self._put(endpoint, conn)
        return Answer(response.status, data, response.getheader("date"))

    def _take(self, endpoint: str) -> http.client.HTTPConnection | None:
        """An idle connection the server has not closed, or None."""
        while True:
            with self._lock:
                idle = self._idle.get(endpoint)
                if not idle:
                    return None
                conn = idle.pop()
            sock = conn.sock
            # An idle socket with something to read has been closed by the server (or has
            # junk on it): a request sent on it would fail after leaving, outcome unknown.
            if sock is not None and not readable([sock.fileno()], 0):
                return conn
            conn.close()

    def _put(self, endpoint: str, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self.closed:
                self._idle.setdefault(endpoint, []).append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Close the idle connections; safe to repeat. Connections in use are closed when
        their request ends."""
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
