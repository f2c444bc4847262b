"""Every decoder that takes outside bytes, as a fuzz target held to `tests.fuzz.contract`.

Each target takes its decoder's natural input (a record value, a list of inbound records, a file's
bytes, DDL text, an environment) and calls only the public function a service calls on it, so the
targets keep their meaning when the codec behind them changes. `TARGETS` adapts each one to raw
bytes for atheris, which only produces bytes, and names its seed inputs.
"""

from __future__ import annotations

import tempfile
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ksb.catalog import ddl
from ksb.catalog.model import load_catalog_file
from ksb.wire.endpoint import Endpoint, decode_endpoint
from ksb.wire.fragments import Reassembler
from ksb.wire.protocol import (
    FragmentRecord,
    parse_bcn,
    parse_inbound,
    parse_queue_record,
    parse_request,
)
from tests.fuzz import corpus
from tests.fuzz.contract import ContractViolation, check

__all__ = [
    "TARGETS",
    "Target",
    "env_from_bytes",
    "run_bcn",
    "run_catalog_yaml",
    "run_ddl",
    "run_endpoint",
    "run_fragments",
    "run_inbound",
    "run_queue_record",
    "run_request",
    "run_settings",
]


def run_request(raw: bytes | None) -> None:
    check(lambda: parse_request(raw), what="parse_request")


def run_inbound(raw: bytes | None) -> None:
    check(lambda: parse_inbound(raw), what="parse_inbound")


def run_fragments(records: list[bytes], now_ms: int = 0) -> None:
    """An ``inbound`` stream as a dispatcher meets it: each record parsed, fragments joined."""
    joiner = Reassembler()
    for raw in records:
        got = check(partial(parse_inbound, raw), what="parse_inbound").value
        if isinstance(got, FragmentRecord):
            check(partial(joiner.offer, got, now_ms), what="Reassembler.offer")


def run_queue_record(raw: bytes | None) -> None:
    check(lambda: parse_queue_record(raw), what="parse_queue_record")


def run_endpoint(raw: bytes) -> None:
    """An endpoint record read back; what decodes must hold its declared types, which the engine
    does arithmetic and look-ups on."""
    ep = check(partial(decode_endpoint, raw), what="decode_endpoint").value
    if isinstance(ep, Endpoint):
        hints = typing.get_type_hints(Endpoint)
        for name in Endpoint.__struct_fields__:
            value, allowed = getattr(ep, name), typing.get_args(hints[name]) or (hints[name],)
            if not any(value is None if t is type(None) else type(value) is t for t in allowed):
                raise ContractViolation(f"decode_endpoint: {name}={value!r} is not {hints[name]}")


def run_bcn(raw: bytes | None) -> None:
    check(lambda: parse_bcn(raw), what="parse_bcn")


_scratch: Path | None = None


def run_catalog_yaml(text: bytes) -> None:
    """A catalog file as `ksb catalog apply FILE` loads it."""
    global _scratch
    if _scratch is None:
        _scratch = Path(tempfile.mkdtemp(prefix="ksb-fuzz-")) / "catalog.yaml"
    _scratch.write_bytes(text)
    path = _scratch
    check(lambda: load_catalog_file(path), what="load_catalog_file")


def run_ddl(text: str) -> None:
    check(lambda: ddl.parse(text), what="ddl.parse")


def run_settings(env: Mapping[str, str]) -> None:
    """Every process's settings model, each reading the same environment."""
    for model in corpus.SETTINGS_MODELS:
        check(partial(model.from_env, env), what=f"{model.__name__}.from_env")


def env_from_bytes(data: bytes) -> dict[str, str]:
    """``NAME=value`` lines; a line without ``=`` is a variable set to the empty string."""
    env: dict[str, str] = {}
    for line in data.decode("utf-8", "replace").split("\n"):
        name, _, value = line.partition("=")
        env[name] = value
    return env


def _env_bytes(env: Mapping[str, str]) -> bytes:
    return "\n".join(f"{k}={v}" for k, v in env.items()).encode()


@dataclass(frozen=True)
class Target:
    """One decoder for atheris: how raw bytes become its input, and real inputs to start from."""

    name: str
    run: Callable[[bytes], None]
    seeds: Callable[[], list[bytes]]


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("request", run_request, corpus.request_records),
        Target("inbound", run_inbound, corpus.inbound_records),
        Target(
            "fragments",
            lambda data: run_fragments(data.split(b"\n")),
            lambda: [b"\n".join(s) for s in corpus.fragment_streams()],
        ),
        Target("queue_record", run_queue_record, corpus.queue_records),
        Target("endpoint", run_endpoint, corpus.endpoint_records),
        Target("bcn", run_bcn, corpus.bcn_records),
        Target("catalog_yaml", run_catalog_yaml, corpus.catalog_texts),
        Target(
            "ddl",
            lambda data: run_ddl(data.decode("utf-8", "replace")),
            lambda: [t.encode() for t in corpus.ddl_texts()],
        ),
        Target(
            "settings",
            lambda data: run_settings(env_from_bytes(data)),
            lambda: [_env_bytes(e) for e in corpus.environments()],
        ),
    )
}
