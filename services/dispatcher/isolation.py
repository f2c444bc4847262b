"""Poison isolation: a record whose transaction Kafka keeps refusing is set aside, not retried
forever.

A dispatcher applies a batch in one transaction; when Kafka refuses it, the batch is redone from
Kafka (`services.dispatcher.recovery`). A record whose outputs Kafka can never take (one past a
topic's size limit, an errors topic that is gone, a topic the dispatcher may not write) failed
the redo too, forever, and held up every record behind it. So failures are counted per record.
Kafka's delivery report of the output it refused names the record that asked for it
(`services.dispatcher.journal`): that record alone is counted, and the batch is redone as usual.
When no report names one (the transaction failed at its commit), every record of the batch is
counted and they are applied one per transaction until the culprit shows. A record counted
`refuse_after` times is refused (an error record to its sender's errors topic, or the
instance's for records without a sender, and its offset committed, in a transaction of its
own), and one whose refusal fails as well is skipped. A failure Kafka itself causes (a broker
away, a coordinator moving) counts for nothing: those records are not at fault, and an outage
must not turn into refusals.

Pure: the pipeline tells what failed and asks what to do with each record.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum

from confluent_kafka import KafkaError

__all__ = ["RECORD_FAULTS", "Coord", "Isolation", "Verdict"]

Coord = tuple[str, int, int]
"""A record's topic, partition and offset."""

RECORD_FAULTS = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError.INVALID_RECORD,
        KafkaError.INVALID_MSG,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._UNKNOWN_TOPIC,
        KafkaError._UNKNOWN_PARTITION,
        KafkaError.TOPIC_EXCEPTION,
        KafkaError.POLICY_VIOLATION,
        KafkaError._INVALID_ARG,
    }
)
"""Kafka's answers that a record's own outputs can cause, and that the same outputs get again."""

_REMEMBERED = 10_000
"""Records whose failures are remembered at most (the oldest go first): a bound, not a knob."""


class Verdict(str, Enum):
    APPLY = "apply"
    """Applied as usual (in the batch, or alone once its batch failed)."""
    REFUSE = "refused"
    """Not applied: an error record says why, and its offset is committed."""
    SKIP = "skipped"
    """Not applied, and no error record either (writing one failed too): only its offset."""


@dataclass(frozen=True)
class _Failures:
    count: int
    reason: str
    named: bool
    """The last failure was pinned on this record by a delivery report."""


@dataclass
class Isolation:
    refuse_after: int
    """A record whose transactions failed this many times is refused."""
    _failures: OrderedDict[Coord, _Failures] = field(default_factory=OrderedDict)

    def failed(self, coords: list[Coord], code: int, reason: str, *, named: bool) -> bool:
        """A transaction failed with Kafka's `code`, because of the records `coords` (`named`:
        a delivery report named them) or of one of them; True when it counts against them."""
        if code not in RECORD_FAULTS:
            return False
        for c in coords:
            before = self._failures.pop(c, None)
            self._failures[c] = _Failures((before.count if before else 0) + 1, reason, named)
        while len(self._failures) > _REMEMBERED:
            self._failures.popitem(last=False)
        return True

    def applied(self, coords: list[Coord]) -> None:
        """These records' transaction committed: nothing against them any more."""
        if self._failures:
            for c in coords:
                self._failures.pop(c, None)

    def suspect(self, coords: list[Coord]) -> bool:
        """Whether any of these records was in a failed transaction that no delivery report
        pinned on one: apply them one by one."""
        if not self._failures:
            return False
        found = (self._failures.get(c) for c in coords)
        return any(f is not None and not f.named for f in found)

    def verdict(self, coord: Coord) -> Verdict:
        f = self._failures.get(coord)
        if f is None or f.count < self.refuse_after:
            return Verdict.APPLY
        return Verdict.REFUSE if f.count == self.refuse_after else Verdict.SKIP

    def reason(self, coord: Coord) -> str:
        """Kafka's last refusal of this record's transaction."""
        f = self._failures.get(coord)
        return f.reason if f is not None else ""
