"""The documents name real code, link to real places, and say what the code does.

ARCHITECTURE.md, the README and docs/ tell a newcomer where each rule lives and how to talk to
KSB; a rename that leaves them pointing at nothing, a link to a moved section, or a protocol page
that drifts from the records would send the next reader to the wrong place, so each of those
fails here. The checks are cheap (text and imports only); the kcat example itself is run against a
real broker by tests/integration/test_protocol_kcat.py.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

from ksb.dialog.receipts import outcome_key
from ksb.wire.protocol import CommitOutcome, Wire

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    "ARCHITECTURE.md",
    "README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
]
README_MAX_LINES = 350
"""Issue 37: the README is what KSB is, the two commands, concepts, the SDK and links; dated runs
and how-tos live in docs/."""

_DOTTED = re.compile(r"`((?:ksb|services|devtools)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`")
_PATH = re.compile(r"(?<![\w/.-])((?:shared/ksb|services|devtools|bench|tests)/[A-Za-z0-9_/.-]+)")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.M)


def _text(doc: str) -> str:
    return (ROOT / doc).read_text()


def _cited(doc: str) -> tuple[set[str], set[str]]:
    text = _text(doc)
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


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to '-'."""
    text = heading.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(doc: str) -> list[str]:
    """The links of `doc` to files of this repository (outside code blocks), as written."""
    text = _FENCE.sub("", _text(doc))
    return [t for t in _LINK.findall(text) if not re.match(r"^[a-z]+:", t)]


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


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_resolves(doc: str) -> None:
    broken = []
    for target in relative_links(doc):
        path, _, anchor = target.partition("#")
        file = (ROOT / doc).parent / path if path else ROOT / doc
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no such heading in {file.relative_to(ROOT)})")
    assert not broken, f"{doc} links to nothing: {broken}"


def test_the_slug_is_githubs() -> None:
    assert slug("Errors (topics `errors.<principal>`, `errors`)") == (
        "errors-topics-errorsprincipal-errors"
    )
    assert slug("Setting up an instance on a `make up` stack") == (
        "setting-up-an-instance-on-a-make-up-stack"
    )


def test_the_readme_is_short() -> None:
    lines = len(_text("README.md").splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): dated runs go to "
        "docs/benchmarks.md, how-tos to docs/"
    )


def _commit_outcomes() -> str:
    text = _text("docs/protocol.md")
    return text.split("**Commit outcomes.**", 1)[1].split("\n### ", 1)[0]


def test_protocol_keys_commit_outcomes_as_the_dispatcher_does() -> None:
    section = _commit_outcomes()
    assert f"`{outcome_key('<group>')}`" in section
    assert "commit/<request_id>" not in _text("docs/protocol.md")


def test_protocol_documents_every_commit_outcome_field() -> None:
    section = _commit_outcomes()
    own = [f for f in CommitOutcome.__struct_fields__ if f not in Wire.__struct_fields__]
    missing = [f for f in own if f"`{f}`" not in section]
    assert not missing, f"docs/protocol.md, Commit outcomes, lacks {missing}"


def _kcat_section() -> str:
    return _text("docs/protocol.md").split("\n## kcat example", 1)[1]


def _request(script: str, kind: str) -> dict[str, object]:
    """The example's `kind` request, its shell-quoted variables made plain."""
    for line in script.splitlines():
        found = re.search(r"'(\{.*\})'", line)
        if found is None:
            continue
        value = re.sub(r"'\"\$\w+\"'", "x", found.group(1))
        record: dict[str, object] = json.loads(value)
        if record.get("kind") == kind:
            return record
    raise AssertionError(f"the kcat example has no {kind!r} request")


def test_the_kcat_examples_grants_are_what_the_dispatcher_checks() -> None:
    """SQL Server's meanings (`ksb.dialog.permissions`): RECEIVE on the queue of the service a
    BEGIN starts from (to act as it), SEND on the service it goes to, nothing more (the example
    RECEIVEs nothing: RECEIVE is the queue service's)."""
    section = _kcat_section()
    sends = re.findall(r"^GRANT SEND ON SERVICE::\[(.+?)\] TO \[(.+?)\]$", section, re.M)
    receives = re.findall(r"^GRANT RECEIVE ON \[(.+?)\] TO \[(.+?)\]$", section, re.M)
    begin = _request(section, "begin")
    assert [s for s, _ in sends] == [begin["to_service"]]
    assert begin["from_service"] == "//t/Initiator" and [q for q, _ in receives] == [
        "InitiatorQueue"
    ]
    assert '"kind":"commit"' not in section
    assert {p for _, p in sends + receives} == {"kcat-app"}
