"""How the benchmarks print a result: a JSON object a line with --json, else key=value."""

from __future__ import annotations

import json
from typing import Any


def emit(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result), flush=True)
    else:
        print(" ".join(f"{k}={v}" for k, v in result.items()), flush=True)
