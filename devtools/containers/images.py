"""`python -m devtools.containers.images`: every image docker-compose.yml runs, built on this machine.

No image registry is reachable from here, while Debian's archive, PyPI and Maven Central are. So
each base image the compose file and the Dockerfile name gets a local stand-in of the same name,
built from Debian's packages and the project's own files (infra/images/<name>/Containerfile):

* the base: ``debootstrap --variant=minbase <suite>`` (the tarball cached in .cache/images),
  imported, plus the machine's extra certificate authorities (`extra_cas`);
* python:3.11-slim-bookworm, maven:3.9-eclipse-temurin-17, redis:7-alpine and
  prom/prometheus:v2.55.1 from Debian 12's packages; apache/kafka:4.2.0 from the broker jars
  `make setup` fetched (.cache/kafka/libs) on Debian's OpenJDK;
* then the KSB image itself, from the project's Dockerfile, as compose would build it.

A stand-in is tagged with the name the compose file uses, so ``FROM python:3.11-slim-bookworm``
and ``image: redis:7-alpine`` resolve to it. Podman's layer cache makes a second run take
seconds. `build_py313` makes a Debian 13 image with Python 3.13 and the project's dependencies
(`make test-py313`). Grafana has no stand-in (no Debian package); the compose test's override
leaves it out.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from devtools.containers.podman import PodmanError, image_exists, podman, podman_env
from devtools.processes import REPO_ROOT

__all__ = [
    "KSB_IMAGE",
    "PY313_IMAGE",
    "STAND_INS",
    "StandIn",
    "build_all",
    "build_py313",
    "extra_cas",
    "main",
    "named_images",
    "normalise",
]

IMAGES_DIR = REPO_ROOT / "infra" / "images"
CACHE_DIR = REPO_ROOT / ".cache" / "images"
LOG_DIR = REPO_ROOT / "var" / "images"
KAFKA_LIBS = REPO_ROOT / ".cache" / "kafka" / "libs"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
DEBIAN_CAS = Path("/usr/share/ca-certificates")
KSB_IMAGE = "localhost/ksb:local"
PY313_IMAGE = "localhost/ksb-py313:latest"
DEBOOTSTRAP_TIMEOUT_S = 900.0
BUILD_TIMEOUT_S = 1800.0
STAND_IN_LABEL = "dev.ksb.stand-in"


@dataclass(frozen=True)
class StandIn:
    """A local image named as the compose file names the real one, built from `directory`."""

    name: str
    directory: str
    suite: str = "bookworm"


# In build order: kafka's Containerfile fetches kafka-tools in a maven stage.
STAND_INS: tuple[StandIn, ...] = (
    StandIn("docker.io/library/python:3.11-slim-bookworm", "python"),
    StandIn("docker.io/library/maven:3.9-eclipse-temurin-17", "maven"),
    StandIn("docker.io/apache/kafka:4.2.0", "kafka"),
    StandIn("docker.io/library/redis:7-alpine", "redis"),
    StandIn("docker.io/prom/prometheus:v2.55.1", "prometheus"),
)


def normalise(name: str) -> str:
    """An image reference as Docker resolves a short one: `redis:7` is
    docker.io/library/redis:7, `apache/kafka:4.2.0` is docker.io/apache/kafka:4.2.0."""
    first, _, rest = name.partition("/")
    if not rest:
        name = f"docker.io/library/{name}"
    elif "." not in first and ":" not in first and first != "localhost":
        name = f"docker.io/{name}"
    last = name.rsplit("/", 1)[1]
    return name if ":" in last or "@" in last else f"{name}:latest"


def named_images(
    compose: Mapping[str, Any], dockerfile: str, skipped: Iterable[str] = ()
) -> set[str]:
    """Every image a deployment pulls: the compose services' (those built from the Dockerfile
    excepted, and `skipped` ones) and the Dockerfile's FROM lines, normalised."""
    built = {
        normalise(str(svc["image"]))
        for svc in compose["services"].values()
        if "build" in svc and "image" in svc
    }
    wanted = {
        normalise(str(svc["image"]))
        for name, svc in compose["services"].items()
        if "image" in svc and name not in set(skipped)
    }
    stages = set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", dockerfile, re.M | re.I))
    froms = {
        normalise(ref)
        for ref in re.findall(r"^FROM\s+(\S+)", dockerfile, re.M | re.I)
        if ref not in stages
    }
    return (wanted - built) | froms


_PEM = re.compile(r"-----BEGIN CERTIFICATE-----\s*(.*?)\s*-----END CERTIFICATE-----", re.S)


def _pem_bodies(text: str) -> list[str]:
    return ["".join(body.split()) for body in _PEM.findall(text)]


def extra_cas(bundle: str, debian: Iterable[str]) -> list[str]:
    """The certificates of `bundle` (the machine's trust store) that are not among `debian`'s
    (the ca-certificates package's own), as PEM: what the machine's administrator added, such
    as a proxy's authority, which a fresh Debian in a container would not trust."""
    known = {body for text in debian for body in _pem_bodies(text)}
    out = []
    for body in _pem_bodies(bundle):
        if body not in known:
            lines = [body[i : i + 64] for i in range(0, len(body), 64)]
            out.append(
                "-----BEGIN CERTIFICATE-----\n" + "\n".join(lines) + "\n-----END CERTIFICATE-----\n"
            )
    return out


def _host_extra_cas() -> list[str]:
    if not HOST_CA_BUNDLE.is_file():
        return []
    debian = [p.read_text() for p in sorted(DEBIAN_CAS.rglob("*.crt"))]
    return extra_cas(HOST_CA_BUNDLE.read_text(), debian)


def _say(message: str) -> None:
    print(f"[images] {message}", flush=True)


def _build(tag: str, context: Path, log_name: str, *extra: str) -> None:
    """`podman build` with its output in var/images/<log_name>.log (its tail shown on failure)."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / f"{log_name}.log"
    started = time.monotonic()
    with log.open("w") as out:
        try:
            done = subprocess.run(
                ["podman", "build", "--tag", tag, "--label", f"{STAND_IN_LABEL}={log_name}",
                 *extra, str(context)],
                cwd=REPO_ROOT, env=podman_env(), stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            raise PodmanError(f"building {tag}: no end in {BUILD_TIMEOUT_S:.0f} s ({log})") from exc
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise PodmanError(f"building {tag} failed ({log}):\n{tail}")
    _say(f"{tag}: {time.monotonic() - started:.0f} s")


def _debootstrap_tarball(suite: str) -> Path:
    """The minbase root of `suite` as a tarball, made once and kept in .cache/images."""
    tarball = CACHE_DIR / f"{suite}-minbase.tar"
    if tarball.is_file():
        return tarball
    if shutil.which("debootstrap") is None:
        raise PodmanError("debootstrap is not installed (make compose-test installs it)")
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
        root = Path(tmp) / "root"
        cmd = ["debootstrap", "--variant=minbase", suite, str(root), DEBIAN_MIRROR]
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=DEBOOTSTRAP_TIMEOUT_S
            )
        except subprocess.TimeoutExpired as exc:
            raise PodmanError(f"{' '.join(cmd)}: no end in {DEBOOTSTRAP_TIMEOUT_S:.0f} s") from exc
        if done.returncode != 0:
            raise PodmanError(f"{' '.join(cmd)} failed: {(done.stdout + done.stderr)[-2000:]}")
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (root / leftover).glob("*"):
                if path.is_file():
                    path.unlink()
        partial = Path(tmp) / "root.tar"
        subprocess.run(
            ["tar", "--numeric-owner", "-C", str(root), "-cf", str(partial), "."],
            check=True, timeout=DEBOOTSTRAP_TIMEOUT_S,
        )  # fmt: skip
        partial.rename(tarball)
    _say(f"debootstrap {suite}: {time.monotonic() - started:.0f} s")
    return tarball


def _base(suite: str) -> None:
    """localhost/ksb-base:<suite>: the debootstrap import plus the machine's extra CAs."""
    imported = f"localhost/ksb-debootstrap:{suite}"
    if not image_exists(imported):
        tarball = _debootstrap_tarball(suite)
        podman("import", "--change", 'CMD ["/bin/bash"]', str(tarball), imported, timeout_s=600)
        _say(f"imported {imported}")
    with tempfile.TemporaryDirectory() as tmp:
        context = Path(tmp)
        shutil.copy(IMAGES_DIR / "base" / "Containerfile", context / "Containerfile")
        cas = context / "ca-certificates"
        cas.mkdir()
        (cas / ".keep").write_text("")
        for i, pem in enumerate(_host_extra_cas()):
            (cas / f"ksb-host-{i}.crt").write_text(pem)
        _build(
            f"localhost/ksb-base:{suite}", context, f"base-{suite}", "--build-arg", f"SUITE={suite}"
        )


def _stand_in(image: StandIn) -> None:
    source = IMAGES_DIR / image.directory
    if image.directory != "kafka":
        _build(image.name, source, image.directory)
        return
    if not (KAFKA_LIBS / ".fetched").is_file():
        raise PodmanError(f"{KAFKA_LIBS} has not been fetched: run `make setup` first")
    with tempfile.TemporaryDirectory() as tmp:
        context = Path(tmp) / "kafka"
        shutil.copytree(source, context)
        libs = context / "libs"
        libs.mkdir()
        for jar in sorted(KAFKA_LIBS.glob("*.jar")):
            if jar.name != "ksb-kafka-assignor.jar":  # compose mounts KSB's assignor itself
                shutil.copy(jar, libs / jar.name)
        _build(image.name, context, image.directory)


def compose_builds(compose: Mapping[str, Any]) -> dict[str, tuple[Path, Path]]:
    """Image (as compose names it, so tagged as compose would tag it) -> (context, Dockerfile)
    of every compose service built from one (`build:` and `image:`)."""
    out: dict[str, tuple[Path, Path]] = {}
    for svc in compose["services"].values():
        build = svc.get("build")
        if build is None or "image" not in svc:
            continue
        spec = {"context": build} if isinstance(build, str) else dict(build)
        context = (REPO_ROOT / str(spec.get("context", "."))).resolve()
        out[str(svc["image"])] = (
            context,
            context / str(spec.get("dockerfile", "Dockerfile")),
        )
    return out


def _compose_files() -> tuple[dict[str, Any], list[str]]:
    """docker-compose.yml, and the services the compose test's override leaves out."""
    compose: dict[str, Any] = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    override = yaml.safe_load((REPO_ROOT / "infra" / "compose" / "test-override.yml").read_text())
    skipped = [n for n, svc in (override.get("services") or {}).items() if "profiles" in svc]
    return compose, skipped


def check_stand_ins(compose: Mapping[str, Any], skipped: Iterable[str]) -> None:
    """Every image the compose file (less what the compose test's override leaves out) and its
    Dockerfiles name has a stand-in here: a new `image:` without one fails before any build."""
    dockerfiles = "\n".join(f.read_text() for _, f in compose_builds(compose).values())
    missing = named_images(compose, dockerfiles, skipped) - {s.name for s in STAND_INS}
    if missing:
        raise PodmanError(f"no stand-in image for {sorted(missing)} (add one to infra/images)")


def build_all(*, ksb: bool = True) -> None:
    """Every stand-in, then (with `ksb`) every image compose builds (the KSB image from the
    Dockerfile, Kafka with KSB's assignor)."""
    compose, skipped = _compose_files()
    check_stand_ins(compose, skipped)
    _base("bookworm")
    for image in STAND_INS:
        _stand_in(image)
    if ksb:
        for tag, (context, dockerfile) in compose_builds(compose).items():
            _build(tag, context, tag.rsplit("/", 1)[-1].split(":")[0], "--file", str(dockerfile))


def build_py313() -> None:
    """The Python 3.13 image (`make test-py313`): Debian 13 and the project's dependencies."""
    _base("trixie")
    _build(PY313_IMAGE, REPO_ROOT, "python313", "--file",
           str(IMAGES_DIR / "python313" / "Containerfile"))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.containers.images", description=__doc__
    )
    parser.add_argument("--no-ksb", action="store_true", help="only the stand-ins")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        build_all(ksb=not args.no_ksb)
    except PodmanError as exc:
        print(f"[images] {exc}", file=sys.stderr)
        return 1
    _say(f"all built in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
