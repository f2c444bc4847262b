"""The queue service of every instance a bench section RECEIVEs on: its replicas, measured.

RECEIVE is the queue service's (`services/queue`), so each instance the bench runs needs its
replicas: `running_queues` starts them as child processes (`devtools.queue_services.QueueReplicas`,
as `make run` does) and yields the instance's settings with every replica as its clients'
``KSB_QUEUE_ADDRESSES``; the SDK clients, and the services the bench starts (activation, external
activator), are made from those. Two replicas by default (`DEFAULT_REPLICAS`, ``--queue-replicas``):
a deployment runs more than one, and each costs its own read of the queue topics and its own
store, which the figures should carry.

A replica's memory is measured apart from its store's pages (`ReplicaMemory`): LMDB maps the store
file, so the pages a RECEIVE reads are the kernel's page cache, counted in the process's RSS as
file-backed (``RssFile``) and dropped by the kernel under pressure, while what the replica itself
holds (the index, its Python objects, librdkafka's buffers) is anonymous memory (``RssAnon``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from devtools.deployment import Deployment
from devtools.queue_services import QueueReplicas

__all__ = [
    "DEFAULT_REPLICAS",
    "ReplicaMemory",
    "replica_memory",
    "replica_pids",
    "running_queues",
    "store_disk_bytes",
]

DEFAULT_REPLICAS = 2
"""Queue service replicas per instance the bench runs (``--queue-replicas``)."""

D = TypeVar("D", bound=Deployment)


@contextlib.contextmanager
def running_queues(
    settings: D, log_dir: Path, replicas: int = DEFAULT_REPLICAS
) -> Iterator[tuple[D, QueueReplicas]]:
    """`replicas` queue service replicas of `settings`' instance, started and ready; yields the
    settings its clients and services use (every replica listed) and the replicas. They are
    stopped on the way out, after an error too."""
    queues = QueueReplicas(settings, log_dir)
    try:
        queues.start(replicas)
        yield queues.client_settings(settings), queues
    finally:
        queues.stop()


def replica_pids(queues: QueueReplicas) -> dict[str, int]:
    """Each live replica's pid, by the name the tables give it (``queue q1``, ...)."""
    return {
        f"queue {name}": p.proc.pid
        for name, p in queues.members.items()
        if p.proc is not None and p.alive()
    }


@dataclass(frozen=True)
class ReplicaMemory:
    """One look at a replica process's memory (kB, from /proc/<pid>/status) and its store."""

    rss_anon_kb: int | None
    """Anonymous resident memory: what the process holds itself."""
    rss_file_kb: int | None
    """File-backed resident pages: the store's pages in the page cache (and the code mapped)."""
    peak_rss_kb: int | None
    """VmHWM: anonymous and file-backed together, at their peak."""
    store_disk_bytes: int | None
    """Bytes the store's files take on disk (allocated blocks: the map is sparse)."""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _status_fields(pid: int, names: tuple[str, ...]) -> dict[str, int | None]:
    found: dict[str, int | None] = dict.fromkeys(names)
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return found
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in found:
            with contextlib.suppress(ValueError, IndexError):
                found[name] = int(rest.split()[0])
    return found


def store_disk_bytes(store_dir: Path) -> int | None:
    """Allocated bytes of every file under `store_dir` (None if it is not there)."""
    if not store_dir.is_dir():
        return None
    return sum(p.stat().st_blocks * 512 for p in store_dir.rglob("*") if p.is_file())


def replica_memory(queues: QueueReplicas, name: str) -> ReplicaMemory:
    """Replica `name`'s memory now (its fields None once it is gone)."""
    proc = queues.members[name].proc
    pid = proc.pid if proc is not None else 0
    f = _status_fields(pid, ("RssAnon", "RssFile", "VmHWM"))
    store = getattr(queues.members[name].settings, "queue_store_dir", None)
    return ReplicaMemory(
        rss_anon_kb=f["RssAnon"],
        rss_file_kb=f["RssFile"],
        peak_rss_kb=f["VmHWM"],
        store_disk_bytes=store_disk_bytes(Path(store)) if store else None,
    )
