"""The random fault-schedule harness in CI (issue 32): on every change, two set-ups chosen from
a seed run under the seed's faults, and one negative control, chosen from the seed too, must
be caught. The seed is printed (and in every failure, with the command that replays it):

    IDMINT_TORTURE_SEED=S pytest tests/test_torture.py -s         # this run again
    IDMINT_TORTURE_SECONDS=600 pytest tests/test_torture.py -s    # longer

Each set-up's faults last TORTURE_SECONDS (12 s in CI), and a run also starts the set-up, waits
for every client to serve again after the faults, and reads every record: about 30 s a set-up.
Long runs (millions of ids, every set-up): bench/torture.py, and docs/guarantees.md.
"""

from __future__ import annotations

import os
import random

from torture_kit import CI_SEED
from torture_kit.run import torture
from torture_kit.setups import SETUPS, SLOW, UNSAFE

SEED = CI_SEED
TORTURE_SECONDS = float(os.environ.get("IDMINT_TORTURE_SECONDS", "12"))
CONTROL_SECONDS = 6.0


def _replay(setup: str, seconds: float, unsafe: bool = False) -> str:
    return f"python bench/torture.py --seed {SEED} --seconds {seconds:g} --setup {setup}" + (
        " --unsafe" if unsafe else ""
    )


def test_two_setups_under_the_seeds_faults_repeat_no_id() -> None:
    picked = random.Random(SEED).sample(sorted(set(SETUPS) - set(SLOW)), 2)
    print(f"\ntorture seed {SEED}: {', '.join(picked)}")
    for setup in picked:
        summary = torture(setup, SEED, TORTURE_SECONDS)
        print(
            f"{setup}: {summary['verdict']}, {summary['ids']:,} ids, faults {summary['faults']}, "
            f"{summary['over_bound']} outages over their bound"
        )
        assert summary["verdict"] == "ok", (
            f"{setup} failed (replay: {_replay(setup, TORTURE_SECONDS)}): {summary['problems']}"
        )
        assert summary["ids"] > 0 and sum(summary["faults"].values()) > 0


def test_the_seeds_negative_control_is_caught() -> None:
    """A harness that never reports anything proves nothing: the set-up's unsafe setting (a
    duplicated static worker id, replication accepted with no gap and cut before a failover,
    quorum nodes that forget) must be caught repeating ids within a short run."""
    setup = random.Random(SEED + 1).choice([u for u in UNSAFE if u not in SLOW])
    summary = torture(setup, SEED, CONTROL_SECONDS, unsafe=True)
    print(f"\ntorture seed {SEED}: negative control {setup}: {summary['problems'][:2]}")
    assert summary["repeated"] > 0, (
        f"the checker missed {summary['unsafe_what']} on {setup} "
        f"(replay: {_replay(setup, CONTROL_SECONDS, unsafe=True)})"
    )
