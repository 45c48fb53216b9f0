"""The random fault-schedule harness (issue 32), run by bench/torture.py and
tests/test_torture.py: set-ups (setups.py), client processes (client.py), the nemesis
(nemesis.py), the checker (checker.py), a run (run.py) and its picture (picture.py)."""

import os
import random

#: The seed of tests/test_torture.py in this test run (IDMINT_TORTURE_SEED replays one), which
#: the run's header prints (conftest.py).
CI_SEED = int(os.environ.get("IDMINT_TORTURE_SEED") or random.SystemRandom().randrange(2**31))
