"""How the benchmarks print a result: a JSON object a line with --json, else key=value."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def emit(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result), flush=True)
    else:
        print(" ".join(f"{k}={v}" for k, v in result.items()), flush=True)


def progress(label: str, done: int, total: int) -> None:
    """A one-line progress bar on stderr (the result goes to stdout)."""
    width = 30
    filled = width * done // max(total, 1)
    end = "\n" if done >= total else ""
    bar = "#" * filled + "." * (width - filled)
    print(f"\r{label:<14} [{bar}] {done}/{total}", end=end, file=sys.stderr, flush=True)


def smoke_option(parser: argparse.ArgumentParser) -> None:
    """--smoke: every phase a fraction of a second, the checks still on. CI runs each script so
    (tests/test_bench.py) to see it still runs; the figures of such a run mean nothing."""
    parser.add_argument(
        "--smoke", action="store_true", help="a quick run that checks the script works (CI)"
    )


def apply_smoke(args: argparse.Namespace, **small: Any) -> None:
    """With --smoke, these small values replace the options' own."""
    if args.smoke:
        vars(args).update(small)
