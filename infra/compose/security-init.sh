#!/bin/sh
# One-shot, as `admin`: put every principal's password (compose secrets, which the entry point
# copied into /run/ksb/secrets) in a credential store inside this container, then make the
# instance in three steps:
#   1. `ksb acl apply`: the services' principals (the operator's among them), core topics, ACLs;
#   2. `ksb catalog apply $CATALOG_FILE` as admin (only admin and the owners write the
#      catalog): the catalog, as its next version;
#   3. `ksb acl apply` again: what that catalog calls for (its grants' principals, queue topics,
#      their ACLs), which step 1 could not know. ACLs are generated from the stored catalog, so
#      this order is what lets every service find its rights on the first `up`.
# Re-run it after a catalog change (`docker compose run --rm -e CATALOG_FILE=... security-init`).
set -eu
secrets=/run/ksb/secrets
store=/tmp/ksb-store
umask 077
mkdir -p "$store"
# ksb-<instance>-<role> for every role of the instance (ksb.security.principals.Role), then the
# application principals the compose catalog grants to (infra/compose/catalog.yaml). A missing
# one would be made by `ksb acl apply` with a password of its own, which no container has.
for role in dispatcher queue transmitter transport forwarder activation external-activator spark operator; do
  cp "$secrets/$role-password" "$store/ksb-$KSB_INSTANCE-$role.password"
done
# Their Redis passwords, for the roles with a Redis user (another password than Kafka's).
for role in queue transmitter transport forwarder activation external-activator operator; do
  cp "$secrets/$role-redis-password" "$store/ksb-$KSB_INSTANCE-$role.redis.password"
done
for app in orders order-service; do
  cp "$secrets/$app-password" "$store/$app.password"
done
# Every step is idempotent, so one that fails (a broker or a name not answering for a moment:
# podman's DNS drops queries while a container starts beside this one) is tried again, up to 5
# times, 3 s apart, before the whole start-up fails on it.
retry() {
  n=1
  until "$@"; do
    [ "$n" -lt 5 ] || return 1
    echo "security-init: step failed (attempt $n of 5), again in 3 s: $*" >&2
    n=$((n + 1))
    sleep 3
  done
}
retry ksb acl apply --store "$store"
retry ksb catalog apply "${CATALOG_FILE:?}"
retry ksb acl apply --store "$store"
