"""A snowflake process for the clock tests: issues ids and reports typed errors, forever.

    python tests/faketime_worker.py URL

Run under libfaketime by tests/test_faketime.py, which moves this process's wall clock.
Prints `I id ...` and `E ErrorClass`, flushing each line.
"""

from __future__ import annotations

import sys
import threading

import idmint
from idmint import IdmintError
from idmint.strategies.snowflake import SnowflakeOptions


def main() -> None:
    pause = threading.Event()  # never set: Event.wait, as time.sleep misbehaves under faketime
    with idmint.connect(sys.argv[1]) as minter:
        gen = minter.snowflake("twitter", SnowflakeOptions(namespace="clock", ttl=3.0))
        while True:
            try:
                line = "I " + " ".join(map(str, gen.next_ids(10)))
            except IdmintError as exc:
                line = f"E {type(exc).__name__}"
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
            pause.wait(0.002)


if __name__ == "__main__":
    main()
