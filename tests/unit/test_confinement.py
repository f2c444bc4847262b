"""Confinement to a process's own secrets: the rules' shape (pure), and the kernel enforcing them
on a real child (skipped where the kernel has no Landlock)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ksb.runtime import confinement
from ksb.runtime.confinement import readable_roots

TREE = {
    Path("/"): ["etc", "srv", "tmp"],
    Path("/srv"): ["stack", "other"],
    Path("/srv/stack"): ["security", "kafka", "stack.json", "current"],
    Path("/srv/stack/security"): ["credentials", "tls"],
}


def _listdir(path: Path) -> list[str]:
    return TREE.get(path, [])


def _resolve(path: Path) -> Path:
    """``/srv/stack/current`` is a link back to the stack (as pytest's ``pytest-current``)."""
    return Path("/srv/stack") if path == Path("/srv/stack/current") else path


def test_everything_is_readable_but_the_way_into_a_denied_directory() -> None:
    roots = readable_roots(
        [Path("/srv/stack/security/credentials")], listdir=_listdir, resolve=_resolve
    )
    assert roots == [
        Path("/etc"),
        Path("/tmp"),
        Path("/srv/other"),
        Path("/srv/stack/kafka"),
        Path("/srv/stack/stack.json"),
        Path("/srv/stack/security/tls"),
    ]


def test_a_link_to_the_way_or_into_a_denied_directory_opens_nothing() -> None:
    roots = readable_roots([Path("/srv/stack/security")], listdir=_listdir, resolve=_resolve)
    assert Path("/srv/stack/current") not in roots  # it would open the whole stack


def test_a_denied_directory_inside_another_counts_as_the_outer() -> None:
    nested = [Path("/srv/stack"), Path("/srv/stack/security/credentials")]
    roots = readable_roots(nested, listdir=_listdir, resolve=_resolve)
    assert roots == [Path("/etc"), Path("/tmp"), Path("/srv/other")]


@pytest.mark.skipif(not confinement.available(), reason="this kernel has no Landlock")
def test_a_confined_child_reads_its_own_secret_and_no_other_root_included(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    (store / "mine").write_text("mine\n")
    (store / "theirs").write_text("theirs\n")
    (tmp_path / "open").write_text("open\n")
    probe = (
        "import sys\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n"
        "        print(p.rsplit('/', 1)[1], open(p).read().strip())\n"
        "    except PermissionError:\n"
        "        print(p.rsplit('/', 1)[1], 'refused')\n"
    )
    paths = [str(store / "mine"), str(store / "theirs"), str(tmp_path / "open")]
    argv = confinement.wrap(
        [sys.executable, "-c", probe, *paths], denied=[str(store)], allowed=[str(store / "mine")]
    )
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.splitlines() == ["mine mine", "theirs refused", "open open"]
