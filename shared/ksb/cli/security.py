"""`ksb acl plan|apply`, `ksb principal add|rotate`: principals and their ACLs, from the catalog.

ACLs are generated from the instance's catalog (grants, routes, event notifications) and its
deployment (`ksb.security.plan`), never written by hand. ``plan`` prints what ``apply`` would
make true; ``apply`` and the ``principal`` commands must run as ``admin``
(``KSB_KAFKA_USERNAME=admin``, ``KSB_REDIS_USERNAME=admin``), the only login allowed to create
users and ACLs. Generated passwords go to the credential store: ``--store``, by default the
directory of the admin's own password file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ksb.cli.app import app, cli_settings, echo_json, reported
from ksb.errors import SecurityError
from ksb.runtime.catalog_store import load_catalog
from ksb.runtime.credentials import CredentialStore
from ksb.security.apply import add_principal, apply_plan, rotate_password
from ksb.security.plan import SecurityPlan, plan_instance
from ksb.settings import CliSettings

__all__: list[str] = []

acl_app = typer.Typer(help="Kafka and Redis ACLs of the instance, generated from its catalog.")
principal_app = typer.Typer(help="Principals: SCRAM users in Kafka, ACL users in Redis.")
app.add_typer(acl_app, name="acl")
app.add_typer(principal_app, name="principal")

Owners = Annotated[
    list[str] | None,
    typer.Option(
        "--owner", help="a principal with the operator's rights that may RECEIVE from every queue"
    ),
]
Store = Annotated[
    Path | None,
    typer.Option("--store", help="credential store (default: the admin's password file's folder)"),
]


def _plan(settings: CliSettings, owners: list[str] | None) -> SecurityPlan:
    return plan_instance(settings, load_catalog(settings), owners=owners or ())


def _store(settings: CliSettings, given: Path | None) -> CredentialStore:
    if given is not None:
        return CredentialStore(given)
    if settings.kafka_password_file:
        return CredentialStore(Path(settings.kafka_password_file).parent)
    raise SecurityError("give --store DIR: the admin logs in without a password file")


@acl_app.command("plan")
@reported
def acl_plan(
    owner: Owners = None,
    as_json: Annotated[bool, typer.Option("--json", help="the plan as JSON")] = False,
) -> None:
    """The principals, topics, Kafka ACLs and Redis rules the catalog calls for."""
    plan = _plan(cli_settings(), owner)
    if as_json:
        echo_json(
            {
                "instance": plan.instance,
                "principals": list(plan.principals),
                "topics": [{"name": t.name, "partitions": t.partitions} for t in plan.topics],
                "kafka_acls": [str(a) for a in plan.kafka_acls],
                "redis": {p: r.acl() for p, r in sorted(plan.redis.items())},
            }
        )
        return
    typer.echo("\n".join(plan.lines()))


@acl_app.command("apply")
@reported
def acl_apply(owner: Owners = None, store: Store = None) -> None:
    """Create the missing users and topics, add the missing ACLs, remove the stale ones."""
    settings = cli_settings()
    plan = _plan(settings, owner)
    report = apply_plan(plan, settings, _store(settings, store))
    typer.echo("\n".join(report.lines()))


@principal_app.command("add")
@reported
def principal_add(
    name: Annotated[str, typer.Argument(help="the principal: 1-64 of A-Z a-z 0-9 _ -")],
    store: Store = None,
) -> None:
    """Create a principal with a generated password (no rights until a grant and `acl apply`)."""
    settings = cli_settings()
    path, created = add_principal(settings, _store(settings, store), name)
    typer.echo(f"{name}: {'created' if created else 'exists'}; password file {path}")


@principal_app.command("rotate")
@reported
def principal_rotate(
    name: Annotated[str, typer.Argument(help="the principal")],
    store: Store = None,
) -> None:
    """A new password: new connections need it at once, open ones keep working."""
    settings = cli_settings()
    path = rotate_password(settings, _store(settings, store), name)
    typer.echo(f"{name}: new password in {path}")
