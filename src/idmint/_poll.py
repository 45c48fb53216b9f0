"""Waiting for sockets to become readable, whatever their descriptor numbers.

select() fails ("filedescriptor out of range") on a descriptor numbered 1024 or more, which a
server's sockets pass at about 1,100 client connections; poll() has no such limit and, unlike a
selectors.DefaultSelector (epoll), costs no descriptor of its own per wait.
"""

from __future__ import annotations

import math
import select
from collections.abc import Iterable

_READABLE = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP


def readable(fds: Iterable[int], timeout: float) -> list[int]:
    """The descriptors among `fds` that are readable (or closed, or failed: a read then says
    why) within `timeout` seconds; 0 looks without waiting."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, _READABLE)
    return [fd for fd, _ in poller.poll(max(0, math.ceil(timeout * 1000)))]
