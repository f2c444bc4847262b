"""Who may change the catalog, and what a new catalog version may ask a host to run.

The catalog decides who may SEND and RECEIVE (grants), where messages go (routes) and what runs
when a queue needs readers (activation), so writing it is an administrator's right, as in SQL
Server, where GRANT, CREATE ROUTE and ALTER QUEUE ... ACTIVATION need CONTROL or ALTER rights
the application users do not have. The rules, made true by Kafka's ACLs and by the catalog's
writers (`ksb sql`, `ksb catalog apply`):

* **The catalog's writers** are the cluster's ``admin`` and the instance's owners (``ksb acl
  apply --owner``, SQL Server's ``db_owner``): only they may write ``ksb.<i>.catalog``. A catalog
  version is one record, so a version is written whole or not at all, and Kafka's ACLs are per
  topic: the operator, who reads everything, and the services, which follow the catalog, may
  not write it at all. Each version records the principal that wrote it (``written_by``); only
  the writers can put a record there, so the claim is one of theirs.
* **Nothing in the catalog is a program.** ``COMMAND`` names a command the activation host's
  own configuration defines (`ksb.activation.host`), never shell text; ``PROCEDURE_NAME`` is a
  Python callable's dotted path, which only code installed on the host answers to.
* **``EXECUTE AS`` is a principal the task logs in as.** An activated task logs in as the
  principal the queue names, with that principal's own login held by the activation host, and
  never with the host's. ``SELF`` and ``OWNER`` have no principal to map to in KSB, and a task
  may not run as the cluster's principals or as a service of the instance (the activation
  service itself above all): such a version is refused, naming the field. Versions stored before
  these rules are still read; the activation host refuses to start what they forbid.

The activation service disables a poisoned queue through a record of its own
(`ksb.wire.queue_status`), not through the catalog. Pure: `ksb.cli.catalog` applies the rules
before it writes, `services.activation` before it starts a task.
"""

from __future__ import annotations

import re

from ksb.catalog.model import Activation, Catalog
from ksb.errors import CatalogError
from ksb.security.principals import CLUSTER_PRINCIPALS, PRINCIPAL_PATTERN, role_of

__all__ = [
    "COMMAND_NAME",
    "PROCEDURE_PATH",
    "check_version",
    "task_principal",
]

COMMAND_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
"""A command's name in the activation host's configuration: a word, never a command line."""

PROCEDURE_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*)?$", re.ASCII)
"""``package.module:function`` (or ``package.module.function``): a Python name, never code."""

UNMAPPED = frozenset({"SELF", "OWNER"})


def task_principal(activation: Activation, instance: str) -> str:
    """The principal a task of `activation` logs in as; `CatalogError` saying why there is none."""
    who = activation.execute_as
    if who.upper() in UNMAPPED:
        raise CatalogError(
            f"EXECUTE AS {who} is not mapped to a principal in KSB: name the principal the "
            "task logs in as (EXECUTE AS 'orders-app'); the activation host holds its login",
            code="execute_as_unmapped",
        )
    if not PRINCIPAL_PATTERN.match(who):
        raise CatalogError(
            f"EXECUTE AS {who!r}: a principal is 1-64 letters, digits, '_' or '-'",
            code="execute_as_unmapped",
        )
    if who in CLUSTER_PRINCIPALS or role_of(instance, who) is not None:
        raise CatalogError(
            f"EXECUTE AS {who!r}: a task never runs as the cluster's or a service's principal "
            "(it would hold that service's rights); name an application principal",
            code="execute_as_refused",
        )
    return who


def _check_activation(a: Activation, instance: str, where: str) -> None:
    if a.command is not None and not COMMAND_NAME.match(a.command):
        raise CatalogError(
            f"{where}.command: {a.command!r} is not a command name: COMMAND names a command of "
            "the activation host's configuration (KSB_ACTIVATION_CONFIG), never a command line",
            code="command_not_named",
        )
    if a.procedure is not None and not PROCEDURE_PATH.match(a.procedure):
        raise CatalogError(
            f"{where}.procedure: {a.procedure!r} is not a Python callable 'module:function'",
            code="procedure_not_named",
        )
    if a.status == "ON":
        try:
            task_principal(a, instance)
        except CatalogError as exc:
            raise CatalogError(f"{where}.execute_as: {exc.reason}", code=exc.code) from None


def check_version(catalog: Catalog, instance: str) -> None:
    """Refuse a catalog version these rules forbid, naming the field (`CatalogError`)."""
    for i, q in enumerate(catalog.queues):
        _check_activation(q.activation, instance, f"queues[{i}].activation")
