"""Several dispatcher processes of one instance: started, added, killed, paused, watched.

The tests, the benchmark, the chaos harness and `make run` run an instance's dispatchers through
this pool. Which shards each member owns is read from its log (each assignment and revocation
logs ``owning [..]``), so the pool can wait until the consumer group has settled: every shard
owned by exactly one live member.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from devtools.runner import ServiceProcess, stop_all
from ksb.settings import KsbSettings

__all__ = ["Applied", "DispatcherPool", "owned_in_log", "shares_settled"]

log = logging.getLogger(__name__)

_OWNING = re.compile(r"owning \[([0-9, ]*)\]")
_APPLIED = re.compile(r"dispatcher (\S+): (\d+) applied in (\d+) transactions")


@dataclass(frozen=True)
class Applied:
    """What a stopped member says it did (its last log line)."""

    records: int
    """Requests and relayed records applied (warm-up and probes included)."""
    transactions: int


def owned_in_log(text: str) -> set[int]:
    """The shards a dispatcher's log says it owns now (its last ``owning [..]``)."""
    found = _OWNING.findall(text)
    if not found or not found[-1].strip():
        return set()
    return {int(s) for s in found[-1].split(",")}


def shares_settled(owned: dict[str, set[int]], shards: int) -> bool:
    """`DispatcherPool.settled` for what each member owns: every shard once, and the members'
    counts within one of each other (none empty) unless there are more members than shards."""
    every = sorted(s for mine in owned.values() for s in mine)
    if every != list(range(shards)):
        return False
    if len(owned) > shards:
        return True
    sizes = [len(mine) for mine in owned.values()]
    return min(sizes) > 0 and max(sizes) - min(sizes) <= 1


@dataclass
class DispatcherPool:
    """The dispatchers of `settings`' instance, each a child process named ``d1``, ``d2``, ..."""

    settings: KsbSettings
    log_dir: Path
    members: dict[str, ServiceProcess] = field(default_factory=dict)
    paused: set[str] = field(default_factory=set)

    @property
    def shards(self) -> int:
        return self.settings.request_partitions

    def start(self, count: int, timeout_s: float = 90) -> DispatcherPool:
        for _ in range(count):
            self.add(wait=False)
        for proc in self.members.values():
            proc.wait_ready("dispatcher ready", timeout_s)
        self.wait_settled(timeout_s)
        return self

    def add(self, *, wait: bool = True, timeout_s: float = 90) -> str:
        """One more member; with `wait`, returns once the group has settled with it in."""
        name = f"d{len(self.members) + 1}"
        proc = ServiceProcess(
            "dispatcher",
            self.settings,
            self.log_dir / f"dispatcher-{name}.log",
            extra_env={"KSB_MEMBER": name},
        ).start()
        self.members[name] = proc
        if wait:
            proc.wait_ready("dispatcher ready", timeout_s)
            self.wait_settled(timeout_s)
        return name

    def owned(self) -> dict[str, set[int]]:
        """Each live, running member's shards, as its log says."""
        return {
            name: owned_in_log(proc.log_text())
            for name, proc in self.members.items()
            if proc.alive() and name not in self.paused
        }

    def settled(self) -> bool:
        """Every shard owned by exactly one live running member, and (while there are no more
        members than shards) each such member holding its fair share, as the shard assignor
        hands them out: the group's assignment is done. Without the share a run could start
        mid-move, with one member still holding shards the assignor has given to others (seen
        in `make bench`: 4, 1, 2 and 1 of 8 shards at the start of a 4-dispatcher run, whose
        members then applied 5,043 to 6,214 records each)."""
        return shares_settled(self.owned(), self.shards)

    def wait_settled(self, timeout_s: float = 90) -> float:
        """Wait until `settled`; returns the seconds it took."""
        started = time.monotonic()
        while not self.settled():
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"dispatchers not settled in {timeout_s}s: {self.owned()}")
            time.sleep(0.05)
        return time.monotonic() - started

    def kill(self, name: str) -> None:
        self.members[name].kill()

    def pause(self, name: str) -> None:
        self.members[name].pause()
        self.paused.add(name)

    def resume(self, name: str) -> None:
        self.members[name].resume()
        self.paused.discard(name)

    def applied(self) -> dict[str, Applied]:
        """What each member that has stopped says it applied, and in how many transactions."""
        found: dict[str, Applied] = {}
        for proc in self.members.values():
            for m in _APPLIED.finditer(proc.log_text()):
                found[m[1]] = Applied(int(m[2]), int(m[3]))
        return found

    def stop(self) -> None:
        for name in list(self.paused):
            self.resume(name)
        for proc in stop_all(list(self.members.values())):
            log.error("dispatcher %s outlived its SIGKILL; see %s", proc.name, proc.log_path)

    def __enter__(self) -> DispatcherPool:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()
