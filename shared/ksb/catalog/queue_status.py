"""A queue's status as the services see it: the catalog's STATUS, unless a status record says OFF.

Two writers decide whether a queue is enabled. The catalog's writers set STATUS in the catalog
(``ALTER QUEUE ... WITH STATUS = OFF``); poison-message handling disables a queue on its own,
through a record of the queue-status topic (`ksb.wire.queue_status`), because the activation
service that notices the poison may not write the catalog. A queue is OFF when either says so.
It comes back ON as in SQL Server, by ``ALTER QUEUE ... WITH STATUS = ON``: `ksb sql` applies its
statements to the catalog as the services see it, and a queue they turn ON that only a status
record held OFF is enabled again by a new status record rather than by the catalog, which
already says ON (`reconcile`). Pure: the records are read and written by
`ksb.runtime.catalog_store`.
"""

from __future__ import annotations

from collections.abc import Mapping

from ksb.catalog.model import Catalog

__all__ = ["disabled_by_status", "effective", "reconcile"]


def effective(catalog: Catalog, disabled: Mapping[str, str]) -> Catalog:
    """`catalog` with every queue that `disabled` (queue -> reason) names set OFF."""
    if not any(q.name in disabled and q.status == "ON" for q in catalog.queues):
        return catalog
    queues = tuple(
        q.model_copy(update={"status": "OFF"}) if q.name in disabled else q for q in catalog.queues
    )
    return catalog.model_copy(update={"queues": queues})


def disabled_by_status(catalog: Catalog, disabled: Mapping[str, str]) -> dict[str, str]:
    """The queues of `catalog` that are OFF only because of a status record, with its reason."""
    return {
        q.name: disabled[q.name] for q in catalog.queues if q.name in disabled and q.status == "ON"
    }


def reconcile(
    stored: Catalog, changed: Catalog, disabled: Mapping[str, str]
) -> tuple[Catalog, list[str]]:
    """What to write after statements were applied to ``effective(stored, disabled)``.

    Returns the catalog to store (a queue a status record holds OFF keeps the catalog's own
    STATUS unless the statements changed it) and the queues to enable by a status record
    (held OFF by one, turned ON by the statements).
    """
    held = disabled_by_status(stored, disabled)
    enable: list[str] = []
    queues = []
    for q in changed.queues:
        if q.name in held:
            if q.status == "ON":
                enable.append(q.name)
            else:  # untouched: the catalog keeps its own ON; the record keeps it OFF
                q = q.model_copy(update={"status": "ON"})
        queues.append(q)
    return changed.model_copy(update={"queues": tuple(queues)}), sorted(enable)
