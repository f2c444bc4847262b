"""One broker instance's variables as a deployment holds them: what the tools start services from.

A compose file (or a `.env` file) holds every ``KSB_*`` variable of an instance in one place, and
each service reads the part its own settings model knows. `Deployment` is that place for the tools
that start a whole instance on this machine (the demo, the benchmarks, the tests): one object with
every field of every service's model, which each process receives narrowed to its own model
(`KsbSettings.narrow`, `SERVICE_SETTINGS`), so what a test starts is what a deployment runs.

Each process logs in as its own principal: `process_settings` gives a service the credentials of
its role (``ksb-<instance>-<role>``, `ksb.security.principals`), the password files coming from
the stack's credential store (``credentials_dir``), as a deployment would mount each service's
own secret. `secure_instance` makes an instance's principals, topics and ACLs (``ksb acl apply``
as ``admin``) and hands back the deployment logged in as the instance's owner, the principal the
tools' own clients use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Self

from devtools.processes import REPO_ROOT
from devtools.stack_security import StackSecurity
from ksb.catalog.model import Catalog
from ksb.runtime.credentials import CredentialStore, write_private
from ksb.security.apply import apply_plan
from ksb.security.plan import SecurityPlan, plan_instance
from ksb.security.principals import ADMIN, Role, service_principal
from ksb.settings import (
    ActivatedTaskSettings,
    ActivationSettings,
    CliSettings,
    DispatcherSettings,
    ExternalActivatorSettings,
    ForwarderSettings,
    KsbSettings,
    QueueServiceSettings,
    SparkSettings,
    TransmitterSettings,
    TransportSettings,
)

__all__ = [
    "MODULE_ROLES",
    "SERVICE_SETTINGS",
    "Deployment",
    "activation_host",
    "connect_clusters",
    "instance_plan",
    "owner_of",
    "process_settings",
    "secure_instance",
    "settings_model",
    "stack_fields",
]


class Deployment(
    DispatcherSettings,
    QueueServiceSettings,
    TransmitterSettings,
    TransportSettings,
    ForwarderSettings,
    ActivationSettings,
    ExternalActivatorSettings,
    SparkSettings,
    CliSettings,
    ActivatedTaskSettings,
):
    """Every variable of one broker instance (a tool's view; no service reads this model)."""

    spark_jars: str = str(REPO_ROOT / ".cache" / "spark" / "jars")
    """Where `make` fetched the connector, wherever a tool starts the job from."""
    credentials_dir: str = ""
    """The stack's credential store: ``<principal>.password`` for every principal (tools only;
    no process reads it, each gets its own file)."""
    private_dirs: str = ""
    """Directories, comma-separated, holding the stack's secrets and data (its work directory):
    a process the tools start reads nothing beneath them but the files its own settings name
    (`devtools.runner`); tools only."""
    task_principals: str = ""
    """Principals, comma-separated, the tools' activation host holds logins for (tasks run as
    them: ``EXECUTE AS``), besides the instance's owner (`owner_of`); tools only."""

    @property
    def secured(self) -> bool:
        return self.kafka_security_protocol != "PLAINTEXT"

    def as_principal(self, name: str) -> Self:
        """These settings logged in as `name` (Kafka and Redis, each with its own password
        file); unchanged on a stack without security."""
        if not self.secured:
            return self
        store = CredentialStore(_path(self.credentials_dir))
        remote = _remote_file(self, name)
        return self.model_copy(
            update={
                "kafka_username": name,
                "kafka_password": "",
                "kafka_password_file": str(store.path(name)),
                "kafka_remote_credentials": str(remote) if remote.exists() else "",
                "redis_username": name,
                "redis_password": "",
                "redis_password_file": str(store.redis_path(name)),
                "principal": name,
            }
        )

    def as_service(self, role: Role) -> Self:
        """These settings as the process of `role` logs in (``ksb-<instance>-<role>``); the
        dispatcher also learns the instance's owner (`owner_of`), whom it lets act for every
        service and queue as `secure_instance` let it in Kafka."""
        settings = self.as_principal(service_principal(self.instance, role))
        if role in (Role.DISPATCHER, Role.QUEUE) and self.secured:
            store = CredentialStore(_path(self.credentials_dir))
            update = {"lease_key_file": str(store.lease_key(self.instance))}
            if not self.owners:
                update["owners"] = owner_of(self.instance)
            settings = settings.model_copy(update=update)
        if role is Role.ACTIVATION and self.secured and not self.activation_config:
            host = activation_host(self, [owner_of(self.instance), *_names(self.task_principals)])
            settings = settings.model_copy(update={"activation_config": str(host)})
        return settings


SERVICE_SETTINGS: dict[str, type[KsbSettings]] = {
    "services.dispatcher": DispatcherSettings,
    "services.queue": QueueServiceSettings,
    "services.transmitter": TransmitterSettings,
    "services.transport": TransportSettings,
    "services.forwarder": ForwarderSettings,
    "services.activation": ActivationSettings,
    "services.external_activator": ExternalActivatorSettings,
    "ksb.spark": SparkSettings,
    "ksb.activation.activated": ActivatedTaskSettings,
}
"""The settings model each runnable module reads (`python -m <module>`)."""


MODULE_ROLES: dict[str, Role] = {
    "services.dispatcher": Role.DISPATCHER,
    "services.queue": Role.QUEUE,
    "services.transmitter": Role.TRANSMITTER,
    "services.transport": Role.TRANSPORT,
    "services.forwarder": Role.FORWARDER,
    "services.activation": Role.ACTIVATION,
    "services.external_activator": Role.EXTERNAL_ACTIVATOR,
    "ksb.spark": Role.SPARK,
}
"""The principal each service module logs in as. An activated task (`ksb.activation.activated`)
logs in as the principal its queue's ``EXECUTE AS`` names, which its activation host gives it."""


def settings_model(module: str) -> type[KsbSettings]:
    """The model `python -m module` reads its settings with."""
    try:
        return SERVICE_SETTINGS[module]
    except KeyError:
        raise KeyError(f"no settings model known for module {module!r}") from None


def process_settings(settings: KsbSettings, module: str) -> KsbSettings:
    """What `python -m module` is started with: `settings` narrowed to its model and, from a
    `Deployment`, logged in as the module's own principal."""
    if isinstance(settings, Deployment) and module in MODULE_ROLES:
        settings = settings.as_service(MODULE_ROLES[module])
    return settings.narrow(settings_model(module))


def stack_fields(security: StackSecurity) -> dict[str, str]:
    """The deployment fields that point every process at a local stack's security."""
    if not security.enabled:
        return {"kafka_security_protocol": "PLAINTEXT"}
    fields = {
        "kafka_security_protocol": security.protocol,
        "kafka_ssl_ca": str(security.ca or ""),
        "credentials_dir": str(security.store.root),
        "private_dirs": str(security.root.parent),
    }
    if security.mode == "tls":  # Redis and the queue service's gRPC over TLS too
        cert, key = security.server_pair("queue")
        fields.update(
            redis_ssl_ca=str(security.stack_ca),
            queue_ssl_ca=str(security.stack_ca),
            queue_ssl_cert=str(cert),
            queue_ssl_key=str(key),
        )
    return fields


def _remote_file(deployment: Deployment, principal: str) -> Path:
    return _path(deployment.credentials_dir) / "remote" / f"{principal}.json"


def connect_clusters(local: Deployment, role: Role, far: Deployment) -> Path:
    """Let `local`'s `role` service log in to `far`'s cluster (a route that leaves its own).

    The far cluster's plan (its routes back to us) made our principal there, with a password in
    the far stack's store; this writes the entry of our principal's remote credentials file
    (``KSB_KAFKA_REMOTE_CREDENTIALS``) that names it, as the far operator would hand it over.
    """
    principal = service_principal(local.instance, role)
    path = _remote_file(local, principal)
    entries = json.loads(path.read_text()) if path.exists() else {}
    entries[far.kafka_bootstrap] = {
        "security_protocol": far.kafka_security_protocol,
        "username": principal,
        "password_file": str(CredentialStore(_path(far.credentials_dir)).path(principal)),
        "ssl_ca": far.kafka_ssl_ca,
    }
    write_private(path, json.dumps(entries, indent=2) + "\n")
    return path


def activation_host(
    deployment: Deployment, principals: list[str], commands: dict[str, list[str]] | None = None
) -> Path:
    """The activation host's configuration file (`ksb.activation.host`) for `deployment`'s
    instance: the logins of `principals` from the stack's store (each its own two files) and
    the named `commands`; written beside the store, readable by its owner only."""
    store = CredentialStore(_path(deployment.credentials_dir))
    logins = {
        p: {
            "kafka_password_file": str(store.path(p)),
            "redis_password_file": str(store.redis_path(p)),
        }
        for p in dict.fromkeys(principals)
    }
    config = {
        "commands": {n: {"argv": argv} for n, argv in (commands or {}).items()},
        "logins": logins,
    }
    path = (
        store.root.parent
        / "hosts"
        / f"{service_principal(deployment.instance, Role.ACTIVATION)}.json"
    )
    write_private(path, json.dumps(config, indent=2) + "\n")
    return path


def _names(value: str) -> list[str]:
    return [n.strip() for n in value.split(",") if n.strip()]


def owner_of(instance: str) -> str:
    """The principal the tools' own clients of `instance` use (an owner: the operator's rights
    plus RECEIVE from every queue)."""
    return f"{instance}-app"


def secure_instance(
    deployment: Deployment, catalog: Catalog | None = None, *, owners: tuple[str, ...] = ()
) -> Deployment:
    """Make `deployment`'s instance usable on a secured stack and return it logged in as its
    owner: one ``ksb acl apply`` as ``admin`` for `catalog` (default: none yet; apply again
    after a catalog whose routes or grants matter). A stack without security needs nothing."""
    if not deployment.secured:
        return deployment
    owner = owner_of(deployment.instance)
    apply_plan(instance_plan(deployment, catalog, owners=(owner, *owners)), *_admin(deployment))
    return deployment.as_principal(owner)


def instance_plan(
    deployment: Deployment, catalog: Catalog | None = None, *, owners: tuple[str, ...] = ()
) -> SecurityPlan:
    """The instance's plan as `secure_instance` applies it (the tests remove it afterwards)."""
    return plan_instance(deployment, catalog or Catalog(), owners=owners)


def _admin(deployment: Deployment) -> tuple[Deployment, CredentialStore]:
    return deployment.as_principal(ADMIN), CredentialStore(_path(deployment.credentials_dir))


def _path(value: str) -> Path:
    return Path(value)
