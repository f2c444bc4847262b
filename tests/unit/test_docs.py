"""The design documents name real code: every module (and attribute) they cite exists.

ARCHITECTURE.md and the README tell a newcomer where each rule lives; a rename that leaves them
pointing at nothing would send the next reader to the wrong place, so a cited path that does not
resolve fails here.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["ARCHITECTURE.md", "README.md", "docs/protocol.md", "docs/audit.md"]
_DOTTED = re.compile(r"`((?:ksb|services|devtools)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`")
_PATH = re.compile(r"(?<![\w/.-])((?:shared/ksb|services|devtools|bench|tests)/[A-Za-z0-9_/.-]+)")


def _cited(doc: str) -> tuple[set[str], set[str]]:
    text = (ROOT / doc).read_text()
    dotted = set(_DOTTED.findall(text))
    paths = {p.rstrip(".,:;)") for p in _PATH.findall(text)}
    return dotted, paths


def _resolves(dotted: str) -> bool:
    """A module, or an attribute (class, function, constant) of the longest module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


@pytest.mark.parametrize("doc", DOCS)
def test_every_cited_module_exists(doc: str) -> None:
    dotted, _paths = _cited(doc)
    missing = sorted(d for d in dotted if not _resolves(d))
    assert not missing, f"{doc} cites modules or names that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_cited_file_exists(doc: str) -> None:
    _dotted, paths = _cited(doc)
    missing = sorted(p for p in paths if "<" not in p and not (ROOT / p).exists())
    assert not missing, f"{doc} cites files that do not exist: {missing}"
