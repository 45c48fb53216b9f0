"""What a quorum key is given (see quorum.py): its node list as text, the checks on a node
list, QuorumOptions, and the figures it reports (NodeHealth, QuorumStats). No I/O and no
threads: the CLI and the server's configuration parse node lists with this alone.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .._errors import InvalidArgument
from ..ids import ID_MAX, check_count

# A node list is URLs joined by commas; a comma inside a URL (etcd://h1:2379,h2:2379/x) is
# not followed by a scheme, so a list splits only where the next URL begins.
_NEXT_URL = re.compile(r",\s*(?=[A-Za-z][A-Za-z0-9+.-]*://)")


def split_nodes(text: str) -> list[str]:
    """The node URLs of "redis://a,redis://b,redis://c" (the form of --quorum and
    IDMINT_QUORUM)."""
    nodes = [part.strip() for part in _NEXT_URL.split(text.strip())]
    if not all(nodes) or "://" not in nodes[0]:
        raise InvalidArgument(
            f"bad node list {text!r}: give store URLs joined by commas, "
            "e.g. redis://a:6379,redis://b:6379,redis://c:6379"
        )
    return check_nodes(nodes)


def check_nodes(urls: Sequence[str]) -> list[str]:
    """`urls` as a list if they can be a quorum key's nodes: an odd number, 3 or more, each
    once."""
    if len(urls) < 3 or len(urls) % 2 == 0:
        raise InvalidArgument(
            f"a quorum key needs an odd number of nodes, 3 or more, not {len(urls)}: with an "
            "even number, one node more can fail for the same cost"
        )
    if len(set(urls)) < len(urls):
        raise InvalidArgument(f"a node is named twice: {', '.join(urls)}")
    return list(urls)


@dataclass(frozen=True)
class QuorumOptions:
    """How a quorum key's rounds run. The defaults suit nodes in one region."""

    #: Seconds a request may take, retries included, before QuorumUnavailable.
    deadline: float = 5.0
    #: The random wait after a lost round is drawn from [0, w], w doubling from first_wait
    #: up to longest_wait (seconds).
    first_wait: float = 0.001
    longest_wait: float = 0.1
    #: Seconds a round waits for a majority of answers. Past it the round counts as lost
    #: (late answers still raise the nodes' counters) and the next one goes without the nodes
    #: that have not answered: a node cut off or frozen holds up a round this long, not until
    #: its connection times out.
    round_wait: float = 0.25
    #: The lowest and highest ids the key hands out (start: above legacy ids).
    start: int = 1
    max: int = ID_MAX
    #: Run on nodes that may lose an acknowledged write (no fsync before the answer): ids can
    #: then repeat after a node's crash. For tests and trials only.
    unsafe: bool = False
    #: Ids one group-commit round claims at most; more waiting requests go in the next one.
    max_batch: int = 1_000_000
    #: Seconds between re-checks of each node while it is used (its durability settings, its
    #: identity, the key's counter on it), besides the re-check after every failed call: a node
    #: made unsafe (CONFIG SET) or restarted empty is left out of rounds within this time.
    recheck: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.deadline <= 3600:
            raise InvalidArgument(f"deadline must be in (0, 3600] seconds, not {self.deadline}")
        if not 0 < self.round_wait <= 60:
            raise InvalidArgument(f"round_wait must be in (0, 60] seconds, not {self.round_wait}")
        if not 0 < self.recheck <= 3600:
            raise InvalidArgument(f"recheck must be in (0, 3600] seconds, not {self.recheck}")
        if not 0 < self.first_wait <= self.longest_wait <= 60:
            raise InvalidArgument("waits must satisfy 0 < first_wait <= longest_wait <= 60")
        check_count(self.start, what="start")
        check_count(self.max, what="max")
        if self.max < self.start:
            raise InvalidArgument(f"max {self.max} is below start {self.start}")
        check_count(self.max_batch, what="max_batch")


@dataclass
class NodeHealth:
    """What the last calls to one node showed (a snapshot in QuorumStats)."""

    url: str
    up: bool | None = None  # None: not asked yet
    counter: int = 0  # the highest counter it answered with (for the key of the snapshot)
    last_error: str | None = None
    last_ok_at: float | None = None  # time.time() of its last answer
    in_flight: bool = False  # a call still runs (a slow or hung node: left out of rounds)
    refused: str | None = None  # why it is never used (unsafe, or a duplicate of another)

    def answered(self, counter: int = 0) -> None:
        self.up, self.last_ok_at, self.last_error = True, time.time(), None
        self.counter = max(self.counter, counter)

    def failed(self, error: BaseException) -> None:
        self.up = False
        self.last_error = " ".join(str(error).split())[:300]


@dataclass(frozen=True)
class QuorumStats:
    key: str
    nodes: list[NodeHealth]
    majority: int
    ids: int  # handed out
    rounds: int  # rounds won
    retries: int  # rounds lost and tried again
    burnt: int  # ids claimed on some node by a lost round: never handed out
    requests: int  # callers served (group commit: many per round)
    largest_batch: int
    failures: int  # requests that ended in an error
    last_error: str | None
    closed: bool
