"""Service Broker's permissions, enforced by the dispatcher: who may act for a service, and who may
receive from a queue.

Kafka's ACLs confine each principal to its own requests topic (``requests.<principal>``), so the
topic a request arrives on names its sender and no other client can forge it (`ksb.names`). The
ACLs cannot see inside a request, though: which service a BEGIN starts from, whose endpoint a SEND
uses, which queue a receipt names. That is checked here, against the catalog's grants:

* ``GRANT SEND ON SERVICE::s TO p``: p may BEGIN dialogs from s and SEND, END and set timers on
  s's endpoints (a reply is sent on the receiving service's endpoint, so a reader that replies
  needs SEND on its own service too);
* ``GRANT RECEIVE ON q TO p``: p may commit receipts on q and move its messages to the dead
  letters (reading q's topic is Kafka's ACL).

Trusted without grants: a request with no principal (the shared ``requests`` topic of a stack
without security, writable by no one but the admin on a secured one), the deployment's owners
(``ksb acl apply --owner``, like SQL Server's db_owner), and the service principals that send for
others: the activation service and the external activator (activated tasks run as them; their
``EXECUTE AS`` is not mapped to principals), the queue service (its dead letters) and the
operator. A revoke takes effect with the
catalog version that carries it, on every dispatcher, without a restart.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ksb.catalog.model import Catalog
from ksb.dialog.sources import Source
from ksb.errors import NotAuthorized
from ksb.security.principals import Role, role_of, service_principal

__all__ = ["OPEN", "Permissions"]

_TRUSTED_ROLES = (Role.ACTIVATION, Role.EXTERNAL_ACTIVATOR, Role.OPERATOR, Role.QUEUE)
_ROLE_SOURCES = {
    Role.ACTIVATION: Source.SERVICE,
    Role.EXTERNAL_ACTIVATOR: Source.SERVICE,
    Role.OPERATOR: Source.OPERATOR,
    Role.QUEUE: Source.QUEUE_SERVICE,
}


@dataclass(frozen=True)
class Permissions:
    """The grants of one catalog version, by principal, and who needs none."""

    send: frozenset[tuple[str, str]] = frozenset()
    """(principal, service) pairs granted SEND."""
    receive: frozenset[tuple[str, str]] = frozenset()
    """(principal, queue) pairs granted RECEIVE."""
    trusted: frozenset[str] = frozenset()
    enforced: bool = True
    instance: str = ""
    owners: frozenset[str] = frozenset()

    @classmethod
    def of(cls, catalog: Catalog, instance: str, owners: Iterable[str] = ()) -> Permissions:
        by_kind: dict[str, set[tuple[str, str]]] = {"SEND": set(), "RECEIVE": set()}
        for g in catalog.grants:
            by_kind[g.permission].add((g.principal, g.target))
        trusted = {service_principal(instance, role) for role in _TRUSTED_ROLES} | set(owners)
        return cls(
            frozenset(by_kind["SEND"]),
            frozenset(by_kind["RECEIVE"]),
            frozenset(trusted),
            instance=instance,
            owners=frozenset(owners),
        )

    def source_of(self, principal: str | None) -> Source:
        """What a requests topic's principal may write (`ksb.dialog.sources`)."""
        if principal is None:
            return Source.SHARED
        if principal in self.owners:
            return Source.OPERATOR
        role = role_of(self.instance, principal) if self.instance else None
        if role is None:
            return Source.APPLICATION
        return _ROLE_SOURCES.get(role, Source.NONE)

    def check_send(self, principal: str | None, service: str, what: str) -> None:
        """Refuse `what` (a BEGIN, a SEND, ...) for `service` unless `principal` may act for it."""
        if self._free(principal) or (principal, service) in self.send:
            return
        raise NotAuthorized(
            f"principal {principal!r} may not {what} for service {service!r}: it lacks "
            f"SEND on SERVICE::[{service}] (GRANT SEND ON SERVICE::[{service}] TO {principal})"
        )

    def check_receive(self, principal: str | None, queue: str, what: str) -> None:
        """Refuse `what` on `queue` unless `principal` may RECEIVE from it."""
        if self._free(principal) or (principal, queue) in self.receive:
            return
        raise NotAuthorized(
            f"principal {principal!r} may not {what} on queue {queue!r}: it lacks RECEIVE "
            f"on {queue} (GRANT RECEIVE ON [{queue}] TO {principal})"
        )

    def _free(self, principal: str | None) -> bool:
        return not self.enforced or principal is None or principal in self.trusted


OPEN = Permissions(enforced=False)
"""No checks: an engine before its dispatcher gives it the catalog's permissions (unit tests)."""
