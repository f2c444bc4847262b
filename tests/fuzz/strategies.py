"""Hypothesis strategies for outside input: real records, bent a little or a lot.

Random bytes almost never get past a JSON parser, so most inputs here start from a real record
(`tests.fuzz.corpus`) and mutate its structure (a field dropped, added, moved, or given a value of
another type or an extreme one), then, sometimes, its bytes (truncated, spliced, flipped). A few
are plain random bytes, for the parser itself.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import strategies as st

__all__ = [
    "json_values",
    "mutated_json",
    "mutated_text",
    "record_bytes",
    "tricky_values",
]

tricky_values: st.SearchStrategy[Any] = st.sampled_from(
    [
        0,
        -1,
        1,
        2**31,
        2**63,
        -(2**63) - 1,
        10**40,
        1.5,
        -0.0,
        1e308,
        True,
        False,
        None,
        "",
        " ",
        "x" * 5000,
        "é",
        "\u0000",
        "\ud800",
        "AAAA",
        "=",
        "1",
        "-1",
        "1e999",
        "SO",
        "CLOSED",
        "inbound",
        "fragment",
        "message",
        "commit_outcome",
        "begin",
        "send",
        [],
        {},
        [None],
        {"": None},
    ]
)
"""Values that sit on edges: limits of integer types, empty and huge strings, lone surrogates,
the wire format's own keywords in the wrong place."""

json_values: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every position inside a JSON value (keys of objects, indexes of arrays)."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _keys(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


def _at(value: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        value = value[step]
    return value


@st.composite
def mutated_json(draw: st.DrawFn, seeds: Sequence[Any], max_mutations: int = 4) -> Any:
    """A seed JSON value with a few structural mutations applied."""
    value = json.loads(json.dumps(draw(st.sampled_from(list(seeds)))))
    names = sorted(set().union(*(_keys(s) for s in seeds)) | {"v", "kind", "zzz"})
    for _ in range(draw(st.integers(0, max_mutations))):
        path = draw(st.sampled_from(_paths(value)))
        op = draw(st.sampled_from(["replace", "tricky", "drop", "add", "wrap", "dup"]))
        if not path:
            if op in ("replace", "wrap"):
                value = draw(json_values) if op == "replace" else [value]
            continue
        parent, last = _at(value, path[:-1]), path[-1]
        if op == "replace":
            parent[last] = draw(json_values)
        elif op == "tricky":
            parent[last] = copy.deepcopy(draw(tricky_values))  # never mutate the shared sample
        elif op == "drop":
            del parent[last]
        elif op == "wrap":
            parent[last] = draw(st.sampled_from([[parent[last]], {"x": parent[last]}]))
        elif op == "add" and isinstance(parent, dict):
            parent[draw(st.sampled_from(names))] = copy.deepcopy(draw(json_values | tricky_values))
        elif op == "dup" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[last]))
    return value


def _dumps(value: Any, ascii_only: bool) -> bytes:
    try:
        return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    except (TypeError, ValueError):
        return b"{}"


@st.composite
def _byte_mutation(draw: st.DrawFn, data: bytes) -> bytes:
    """Truncate, splice random bytes into, or flip a byte of `data`."""
    if not data:
        return draw(st.binary(max_size=8))
    i = draw(st.integers(0, len(data) - 1))
    op = draw(st.sampled_from(["truncate", "insert", "flip", "delete"]))
    if op == "truncate":
        return data[:i]
    if op == "insert":
        return data[:i] + draw(st.binary(min_size=1, max_size=8)) + data[i:]
    if op == "flip":
        return data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :]
    return data[:i] + data[i + draw(st.integers(1, 8)) :]


@st.composite
def record_bytes(draw: st.DrawFn, seeds: Callable[[], list[bytes]]) -> bytes:
    """A record value: a mutated real record (mostly), sometimes byte-mangled, or random bytes."""
    real = [json.loads(s) for s in seeds()]
    kind = draw(st.sampled_from(["json", "json", "json", "bytes-mutated", "random"]))
    if kind == "random":
        return draw(st.binary(max_size=64))
    data = _dumps(draw(mutated_json(real)), draw(st.booleans()))
    if kind == "bytes-mutated":
        for _ in range(draw(st.integers(1, 3))):
            data = draw(_byte_mutation(data))
    return data


_numbers: st.SearchStrategy[str] = st.one_of(
    st.integers().map(str),
    st.integers(0, 13).map(lambda k: "9" * 2**k),
)
"""Numbers of every magnitude (1 to 8,192 digits, log-uniform): a number in a text is where
limits live, and uniform sizes would almost never be long."""


@st.composite
def mutated_text(draw: st.DrawFn, seeds: Callable[[], list[str]]) -> str:
    """A real text (DDL, YAML) with lines cut, repeated or swapped, characters spliced in, and
    numbers replaced by others of any size."""
    lines = draw(st.sampled_from(seeds())).split("\n")
    for _ in range(draw(st.integers(0, 6))):
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(
            st.sampled_from(["cut", "repeat", "swap", "splice", "truncate", "drop", "renumber"])
        )
        numbers = list(re.finditer(r"[0-9]+", lines[i]))
        if op == "renumber" and numbers:
            where = draw(st.sampled_from(numbers))
            line = lines[i]
            lines[i] = line[: where.start()] + draw(_numbers) + line[where.end() :]
        elif op == "drop":
            del lines[i]
        elif op == "repeat":
            lines.insert(i, lines[i])
        elif op == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "truncate":
            lines = lines[: i + 1]
        else:
            line = lines[i]
            k = draw(st.integers(0, len(line)))
            if op == "cut":
                lines[i] = line[:k]
            else:
                piece = draw(
                    st.sampled_from(["'", '"', "[", "]", "(", ")", ",", "=", "N'", "*", ":", "-"])
                    | st.text(max_size=6)
                    | _numbers
                )
                lines[i] = line[:k] + piece + line[k:]
    return "\n".join(lines)
