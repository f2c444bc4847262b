"""The queues one replica serves: each queue's fold, under one lock, and the store of their records.

The follower (`services.queue.service`) folds every queue topic under `cond` and writes the
store in the same hold, so a RECEIVE that finds a message in an index finds its record too; the
calls read indexes under `cond` and the store outside it (LMDB readers take no lock). `cond` is
also what a RECEIVE that waits (WAITFOR) waits on: every batch the follower folds wakes them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from ksb.errors import CatalogError
from ksb.queue.bodies import BodyStore, store_key
from ksb.queue.fold import Folded, QueueFold
from ksb.queue.index import Ready
from ksb.wire.protocol import QueueMessage, parse_queue_record

__all__ = ["Queues"]


class Queues:
    """Every queue's fold, by name, and the store."""

    def __init__(self, store: BodyStore) -> None:
        self.cond = threading.Condition()
        self.store = store
        self._folds: dict[str, QueueFold] = {}
        self._next_id = 1

    def add(self, name: str, partitions: int) -> QueueFold | None:
        """Serve `name` from now on (its topic is read from the beginning); None if served."""
        with self.cond:
            if name in self._folds:
                return None
            fold = self._folds[name] = QueueFold(name, self._next_id, partitions)
            self._next_id += 1
            self.cond.notify_all()
            return fold

    def get(self, name: str, *, wait_s: float = 0.0) -> QueueFold:
        """The fold of a queue this replica serves; `CatalogError` (unknown_queue) otherwise.
        With `wait_s`, a queue not known yet is waited for that long: a catalog that adds a
        queue reaches this replica a poll after it reaches the client that asks for it."""
        fold = self._folds.get(name)
        if fold is None and wait_s > 0:
            with self.cond:
                self.cond.wait_for(lambda: name in self._folds, wait_s)
            fold = self._folds.get(name)
        if fold is None:
            raise CatalogError(f"unknown queue {name!r}", code="unknown_queue")
        return fold

    def names(self) -> list[str]:
        return list(self._folds)

    def folds(self) -> Iterable[QueueFold]:
        return list(self._folds.values())

    def write(self, out: Folded) -> None:
        """The store's part of a folded batch (the caller holds `cond`)."""
        if out.puts or out.deletes:
            self.store.apply(out.puts, out.deletes)

    def records(self, fold: QueueFold, refs: list[Ready]) -> list[QueueMessage]:
        """The messages `refs` name, from the store, in their order. One no longer there was
        received meanwhile (a stale holder's commit) and is left out."""
        raws = self.store.get_many([store_key(fold.queue_id, r.position) for r in refs])
        out = []
        for raw in raws:
            if raw is None:
                continue
            record = parse_queue_record(raw)
            if isinstance(record, QueueMessage):
                out.append(record)
        return out
