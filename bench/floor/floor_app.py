"""The floor of bench/http.py: a bare granian RSGI app that answers a counter, nothing else."""

from __future__ import annotations

import itertools
from typing import Any

_counter = itertools.count(1)
_headers = [("content-type", "text/plain; charset=utf-8")]


async def app(scope: Any, proto: Any) -> None:
    proto.response_str(200, _headers, str(next(_counter)))
