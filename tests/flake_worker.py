"""A snowflake process for the lease tests: takes a worker id, issues ids, releases, repeats.

    python tests/flake_worker.py URL NAMESPACE TTL [--hold SECONDS] [--worker-id N [--state F]]

Prints, flushing each line: `L worker time` when it holds a lease, `I id id ...` for ids issued,
`R worker time` just before it releases, `E error-class` on a typed error. The tests read these
to check that no two live processes held one worker id at once and that no id repeats.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import idmint
from idmint import IdmintError
from idmint.layout import Layout
from idmint.strategies.snowflake import SnowflakeOptions

# Eight worker ids for sixteen processes: they must take turns.
LAYOUT = Layout("test8", 41, 3, 12, tick_ms=1, epoch_ms=1_700_000_000_000)


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("namespace")
    parser.add_argument("ttl", type=float)
    parser.add_argument("--hold", type=float, default=2.0, help="seconds to hold a lease")
    parser.add_argument("--exact", action="store_true", help="hold exactly --hold seconds")
    parser.add_argument("--worker-id", type=int, help="claim this worker id statically")
    parser.add_argument("--state", help="and keep its horizon in this file too")
    args = parser.parse_args()
    options = SnowflakeOptions(namespace=args.namespace, ttl=args.ttl)
    with idmint.connect(args.url) as minter:
        while True:
            try:
                gen = minter.snowflake(LAYOUT, options, worker_id=args.worker_id, state=args.state)
            except IdmintError as exc:
                say(f"E {type(exc).__name__}")
                time.sleep(0.1)
                continue
            say(f"L {gen.worker_id} {time.time():.6f}")
            until = time.monotonic() + (args.hold if args.exact else random.uniform(0.2, args.hold))
            while time.monotonic() < until:
                try:
                    say("I " + " ".join(map(str, gen.next_ids(20))))
                    time.sleep(0.005)  # a steady trickle: the test checks turns, not speed
                except IdmintError as exc:
                    say(f"E {type(exc).__name__}")
                    time.sleep(0.05)
            say(f"R {gen.worker_id} {time.time():.6f}")
            gen.close()


if __name__ == "__main__":
    main()
