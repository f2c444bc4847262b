#!/bin/sh
# One-shot, as `admin`: put every principal's password (from compose's git-ignored .env) in a
# credential store inside this container, then `ksb acl apply`: the users, topics and ACLs of the
# instance, generated from its catalog (applied again after each catalog change: re-run this).
set -eu
store=/tmp/ksb-store
umask 077
mkdir -p "$store"
for role in dispatcher transmitter transport forwarder activation external-activator spark operator; do
  var="PASSWORD_$(echo "$role" | tr "a-z-" "A-Z_")"
  eval "pw=\${$var:?$var is not set: run python -m devtools.compose_env}"
  printf '%s\n' "$pw" > "$store/ksb-$KSB_INSTANCE-$role.password"
done
exec ksb acl apply --store "$store"
