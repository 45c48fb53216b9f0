"""A process taking ids of a quorum key, recorded for the fault harness.

    python tests/quorum_worker.py KEY URL,URL,URL [--threads N] [--rate N] [--unsafe]
                                  [--stop-before-claim N]

Prints, flushing every 20 ms (a kill -9 loses at most the last 20 ms, never reports an id it
did not get), the harness's lines:

    O t0 t1 id          a call that returned id (t0, t1: monotonic seconds)
    E t0 t1 Error       a call that raised Error (then the thread waits 50 ms and goes on)
    C {...}             on SIGTERM, the key's stats, then it exits

Threads share one QuorumGenerator (group commit). --rate paces each thread (calls a second;
0: flat out). --stop-before-claim N: the process stops itself (SIGSTOP) once, in its Nth
round, after it chose the round's ids and before it sends a claim; the harness resumes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
import time

from idmint import QuorumOptions, open_quorum
from idmint.strategies.quorum_nodes import split_nodes

from dc_worker import Log, record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("key")
    parser.add_argument("nodes")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rate", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=1.0)
    parser.add_argument("--deadline", type=float, default=3.0)
    parser.add_argument("--unsafe", action="store_true")
    parser.add_argument("--stop-before-claim", type=int, default=0)
    args = parser.parse_args()

    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    log = Log()
    options = QuorumOptions(unsafe=args.unsafe, deadline=args.deadline)
    gen = open_quorum(args.key, split_nodes(args.nodes), options, timeout=args.timeout)
    if args.stop_before_claim:
        rounds = iter(range(1, 10**9))

        def stop_once(start: int, end: int) -> None:
            if next(rounds) == args.stop_before_claim:
                log.add(f"# stopping before claiming {start}..{end}")
                log.flush()
                os.kill(os.getpid(), signal.SIGSTOP)

        gen.counter.before_claim = stop_once

    def call_loop() -> None:
        pace = 1.0 / args.rate if args.rate else 0.0
        due = time.monotonic()
        while not stopping.is_set():
            if not record(log, gen.next_id):
                time.sleep(0.05)
                continue
            if pace:
                due += pace
                time.sleep(max(0.0, due - time.monotonic()))

    threads = [threading.Thread(target=call_loop, daemon=True) for _ in range(args.threads)]
    for t in threads:
        t.start()
    while not stopping.is_set():
        time.sleep(0.02)
        log.flush()
    for t in threads:
        t.join(2 * args.deadline + 2)
    stats = dataclasses.asdict(gen.stats())
    gen.close()
    log.add("C " + json.dumps({k: v for k, v in stats.items() if k != "nodes"}))
    log.flush()
    sys.exit(0)


if __name__ == "__main__":
    main()
