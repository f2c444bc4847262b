#!/bin/sh
# The KSB containers' entry point in docker-compose.yml: hand this container's secrets to the
# image's user, then run the command as that user.
#
# Compose (Docker's and podman's alike) gives a container its `secrets:` by bind-mounting each file
# under /run/secrets with the host file's owner and mode, 0600 as devtools.compose_env writes them:
# the image's user, ksb, cannot read them (compose ignores a secret's uid and mode for a file).
# So the container starts as root (compose's `user: "0"`) and this copies each secret into
# /run/ksb/secrets (a tmpfs compose mounts: never on disk), readable by ksb alone, then drops to
# ksb for good. The processes read their passwords from there (KSB_*_PASSWORD_FILE), so no
# password is in any environment, and what they start (activated tasks, the external activator's
# readers) gets the file's path, not the password.
set -eu
if [ "$(id -u)" = 0 ]; then
  install -d -o ksb -g ksb -m 0500 /run/ksb/secrets
  for secret in /run/secrets/*; do
    [ -f "$secret" ] || continue
    install -o ksb -g ksb -m 0400 "$secret" "/run/ksb/secrets/${secret##*/}"
  done
  HOME=/home/ksb exec setpriv --reuid=ksb --regid=ksb --init-groups -- "$@"
fi
exec "$@"
