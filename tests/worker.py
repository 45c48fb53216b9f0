"""A process that takes ids from a store and prints them, for the multi-process tests.

    python tests/worker.py URL KEY COUNT [--small-steps]

Prints ids one per line, flushing after every batch, so a `kill -9` loses at most the batch
being printed (never reports an id that was not handed out). COUNT 0 means run until killed.
Store outages are waited out: the tests restart stores under running workers.
"""

from __future__ import annotations

import argparse
import sys
import time

import idmint
from idmint import SegmentOptions, StoreUnavailable


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("key")
    parser.add_argument("count", type=int)
    parser.add_argument("--small-steps", action="store_true")
    args = parser.parse_args()
    options = (
        SegmentOptions(max_step=40, preload_at=0.5, wait=5.0)
        if args.small_steps
        else SegmentOptions(wait=5.0)
    )
    out = sys.stdout
    done = 0
    with idmint.connect(args.url, segment_options=options) as minter:
        gen = minter.segment(args.key)
        while args.count == 0 or done < args.count:
            try:
                if args.small_steps and done % 3 == 0:
                    ids = list(minter.take(args.key, 5))  # straight from the store as well
                else:
                    ids = gen.next_ids(min(1000, args.count - done) if args.count else 10)
            except StoreUnavailable:
                time.sleep(0.05)
                continue
            out.write("\n".join(map(str, ids)) + "\n")
            out.flush()
            done += len(ids)


if __name__ == "__main__":
    main()
