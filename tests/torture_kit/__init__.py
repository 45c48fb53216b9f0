"""The random fault-schedule harness (issue 32), run by bench/torture.py and
tests/test_torture.py: set-ups (setups.py), client processes (client.py), the nemesis
(nemesis.py), the checker (checker.py), a run (run.py) and its picture (picture.py)."""
