"""Random fault schedules from a seed over a set-up, one checker over every id (issue 32).

    python bench/torture.py --seed 7 --seconds 30 --setup redis-replica --json
    python bench/torture.py --seed 7 --seconds 20 --setup quorum-redis5 --unsafe   # must fail
    python bench/torture.py --smoke --json                                      # CI's check

A set-up (tests/torture/setups.py; without --setup the seed picks one) starts its stores and
keys; client processes take ids through the library, the CLI, `idmint serve` over HTTP and
idmint.Client, on plain, 32-bit, striped, snowflake and quorum keys, each call recorded; the
nemesis (tests/torture/nemesis.py) draws faults from the seed, overlapping, for --seconds;
then every client is stopped and the checker (tests/torture/checker.py) reads every record:
no id twice, every id within its key's bounds, each process's ids going up where promised,
quorum ids strictly increasing in real time, snowflake ids in time order per worker id; and
for each fault, the longest outage a client it did not hit saw, against the bound.

--unsafe runs the set-up's negative control (a setting the docs call unsafe): the checker must
catch it. The run's picture (an HTML page: ids/s per client, faults as bands, errors as marks,
the verdict) is written to --picture (default: torture-SETUP-SEED.html in the temp folder).
With --json the last line is the summary: ids, repeated, faults, setup, verdict, ... A failed
run prints the command that replays its schedule and exits 1.

Needs root (iptables for partitions) and the test suite's servers (.ci/install).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

# In this order: report.py from this folder first, as importing httpx (the harness does) takes
# this folder off the path (bench/http.py stands in for the standard library's http here).
# isort: off
from report import apply_smoke, smoke_option

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from torture_kit.picture import render_html  # noqa: E402
from torture_kit.run import torture  # noqa: E402
from torture_kit.setups import SETUPS, UNSAFE  # noqa: E402

# isort: on


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seed", type=int, help="the schedule's seed [default: a random one]")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long faults go on")
    parser.add_argument("--setup", choices=sorted(SETUPS), help="[default: the seed's pick]")
    parser.add_argument("--unsafe", action="store_true", help="the set-up's negative control")
    parser.add_argument("--json", action="store_true", help="the summary as JSON, last line")
    parser.add_argument("--picture", type=Path, help="where the run's HTML page goes")
    parser.add_argument("--keep", type=Path, help="keep the clients' records in this folder")
    parser.add_argument(
        "--batch-scale",
        type=int,
        default=1,
        metavar="N",
        help="multiply every client's batch by N (long runs: more ids, as many calls)",
    )
    smoke_option(parser)
    args = parser.parse_args()
    apply_smoke(args, seconds=5.0, setup=args.setup or "sqlite")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    setup = args.setup or random.Random(seed).choice(sorted(UNSAFE if args.unsafe else SETUPS))
    if args.unsafe and setup not in UNSAFE:
        parser.error(f"set-up {setup} has no negative control; those with one: {', '.join(UNSAFE)}")
    print(f"torture: setup {setup}, seed {seed}, {args.seconds:g} s", file=sys.stderr, flush=True)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    if args.batch_scale < 1:
        parser.error("--batch-scale must be 1 or more")
    summary = torture(
        setup,
        seed,
        args.seconds,
        unsafe=args.unsafe,
        workdir=args.keep,
        batch_scale=args.batch_scale,
    )
    picture = args.picture or Path(tempfile.gettempdir()) / f"torture-{setup}-{seed}.html"
    picture.write_text(render_html(summary))
    summary["picture"] = str(picture)
    summary["replay"] = replay_command(setup, seed, args.seconds, args.unsafe, args.batch_scale)
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "timeline"}))
    else:
        for name in ("setup", "seed", "verdict", "ids", "repeated", "faults", "over_bound"):
            print(f"{name:12} {summary[name]}")
        for problem in summary["problems"]:
            print(f"problem      {problem}")
        print(f"picture      {picture}")
    failed = summary["verdict"] != "ok"
    if failed != args.unsafe:
        print(f"replay: {summary['replay']}", file=sys.stderr)
        sys.exit(1)


def replay_command(
    setup: str, seed: int, seconds: float, unsafe: bool, batch_scale: int = 1
) -> str:
    return (
        f"python bench/torture.py --seed {seed} --seconds {seconds:g} --setup {setup}"
        + (" --unsafe" if unsafe else "")
        + (f" --batch-scale {batch_scale}" if batch_scale != 1 else "")
    )


if __name__ == "__main__":
    main()
