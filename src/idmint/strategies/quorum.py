"""Quorum keys: ids strictly increasing in real time across every caller, from a majority of N
independent nodes (antirez's algorithm), with group commit.

Each node keeps a counter per key that only moves up, changed by one atomic step:

    claim(start, end): if counter < start then counter = end, answer yes; else answer no and
                       the counter

A round claims [start, end] on every node at once and wins when a majority says yes. Why that
is enough, for any start:

- Unique. Two winning rounds share a node (two majorities meet). Whichever reached it first
  left its counter at its end; the second applied there only because the counter was below
  its start. So the second range lies wholly above the first.
- Strictly increasing in real time. If round A won before round B began, a majority holds at
  least A's end; B's majority meets it at a node that let B apply, so B's start is above A's
  end.

Neither argument uses how `start` was chosen, so no round reads first: `start` is one above the
highest counter this process has seen, and a refusal carries the node's counter, which the next
try starts above. A round is one round trip (one fsync on each node), not antirez's two, and a
stale guess costs one refused round. The proof needs every acknowledged claim to survive a
crash of its node: a node that comes back with a lower counter can let a later round take ids
again. Hence the refusal of nodes that do not fsync before answering (`durability()`).

Contention: callers who claim the same start at once may split the nodes so that nobody has
a majority; every one of them retries above what it saw, after a random wait that doubles
each time (up to `longest_wait`), until `deadline`, then QuorumUnavailable. Group commit
(QuorumGenerator) avoids it within a process: callers that arrive while a round runs wait for
the next one, which claims all their ids at once and hands them out in arrival order. Each of
them began before that round did, so every id is above each id handed out before its caller
asked.
"""

from __future__ import annotations

from .quorum_counter import MAX_SPREAD, OVERDUE, QuorumCounter
from .quorum_generator import QuorumGenerator, checked_quorum
from .quorum_nodes import QuorumNodeSet
from .quorum_options import NodeHealth, QuorumOptions, QuorumStats, check_nodes, split_nodes

# This module is the strategy's public face: its parts live in quorum_options.py (node lists,
# options, figures), quorum_nodes.py (the nodes a node list's keys share), quorum_counter.py
# (one key's rounds) and quorum_generator.py (group commit, and a key opened with its nodes
# checked).
__all__ = [
    "MAX_SPREAD",
    "OVERDUE",
    "NodeHealth",
    "QuorumCounter",
    "QuorumGenerator",
    "QuorumNodeSet",
    "QuorumOptions",
    "QuorumStats",
    "check_nodes",
    "checked_quorum",
    "split_nodes",
]
