"""Who there is: the principals of a broker instance, and the rule for a principal's name.

Each service process of an instance logs in as its own principal, ``ksb-<instance>-<role>``, so
what one service may touch is exactly what its role needs (`ksb.security.kafka_acls`,
`ksb.security.redis_acls`), and a compromised service is confined to its role. The operator (the
`ksb` CLI of someone running the instance) is one more role. Applications are principals chosen by
the user and given SEND and RECEIVE by the catalog's grants. Two principals belong to the cluster,
not to an instance: ``broker`` (the brokers' own inter-broker login) and ``admin`` (the tool that
creates users and ACLs); they are Kafka's only super users.

A principal is a SCRAM user in Kafka and an ACL user of the same name in Redis. Its name is part
of topic names (``ksb.<i>.requests.<principal>``), so it is restricted to characters that are
literal in topic names, ACL resource names and Redis ACL rules: letters, digits, ``_`` and ``-``,
1 to 64 of them.
"""

from __future__ import annotations

import re
from enum import Enum

from ksb.errors import SecurityError

__all__ = [
    "ADMIN",
    "BROKER",
    "CLUSTER_PRINCIPALS",
    "PEER_PREFIX",
    "PRINCIPAL_PATTERN",
    "Role",
    "check_principal",
    "peer_principal",
    "role_of",
    "service_principal",
    "service_principals",
]

PRINCIPAL_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

BROKER = "broker"
"""The brokers' inter-broker login (a super user)."""
ADMIN = "admin"
"""The ACL tool's login (`ksb acl apply`, `ksb principal add`): a super user in Kafka, and the
one Redis user allowed everything."""
CLUSTER_PRINCIPALS = frozenset({BROKER, ADMIN})


class Role(str, Enum):
    """A service process (or the operator) of one instance; the value is the name's suffix."""

    DISPATCHER = "dispatcher"
    QUEUE = "queue"
    TRANSMITTER = "transmitter"
    TRANSPORT = "transport"
    FORWARDER = "forwarder"
    ACTIVATION = "activation"
    EXTERNAL_ACTIVATOR = "external-activator"
    SPARK = "spark"
    OPERATOR = "operator"


PEER_PREFIX = "peer-"
"""Grants to ``peer-<instance>`` are another broker instance's, checked when its messages arrive
(`ksb.dialog.permissions`): no login has such a name, `ksb.security.access` makes none."""


def peer_principal(instance: str) -> str:
    """The principal another broker instance acts as here (the remote service binding's user)."""
    return f"{PEER_PREFIX}{instance}"


def check_principal(name: str) -> str:
    """`name` if it can be a principal; `SecurityError` saying why not otherwise."""
    if not PRINCIPAL_PATTERN.match(name):
        raise SecurityError(
            f"principal {name!r}: 1-64 letters, digits, '_' or '-' (it is part of topic names)"
        )
    if name in CLUSTER_PRINCIPALS:
        raise SecurityError(f"principal {name!r} is reserved for the cluster")
    return name


def service_principal(instance: str, role: Role) -> str:
    """``ksb-<instance>-<role>``: the principal of one role of one instance."""
    return check_principal(f"ksb-{instance}-{role.value}")


def service_principals(instance: str) -> dict[Role, str]:
    return {role: service_principal(instance, role) for role in Role}


def role_of(instance: str, principal: str) -> Role | None:
    """The role `principal` plays in `instance`, or None for an application principal."""
    for role, name in service_principals(instance).items():
        if name == principal:
            return role
    return None
