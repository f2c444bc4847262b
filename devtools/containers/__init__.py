"""Containers on this machine: podman with the project's containers.conf, the stand-in images
that docker-compose.yml needs, and the compose run `make compose-test` checks."""
