"""Confining a child process to its own secrets: it reads no file under the directories it is
denied, but the few files it is allowed there.

Every process of one machine's KSB runs as the same Unix user (the local stack, the tests, a
host's activated tasks), so file modes cannot keep one process's password from another. Linux's
Landlock can: an unprivileged process may give up rights for itself and every process it starts,
and nothing it runs later (a task's procedure, a named command) can take them back, root
included. A confined process may read every file except those beneath a *denied* directory (the
stack's secrets, the credential store), where it may read only the files it is *allowed* (its
own password files, the CA it trusts).

Landlock only grants: every read is refused unless a rule allows it. So the rules are the
complement of the denied directories (`readable_roots`): beneath each directory on the way from
``/`` to a denied one, every entry but the one leading on. An entry created later in such a
directory (not beneath one of its existing entries) is not readable; the tools create what a
process will read before they start it. Rules hold inodes: a rotated password (a new file in
the old one's place) is not readable by a process started before the rotation, which has to be
restarted, as docs/security.md says of rotation anyway.

Used as a wrapper, so that the child is confined before it runs any of its own code:
``python -m ksb.runtime.confinement --deny DIR --allow FILE -- program args...`` (`wrap`).
On a kernel without Landlock the wrapper runs the program unconfined and says so on stderr.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

__all__ = ["available", "confine", "main", "readable_roots", "wrap"]

_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
"""The Landlock system calls (the same numbers on every architecture Linux unified them on)."""
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_ACCESS_READ_FILE = 1 << 2
_PR_SET_NO_NEW_PRIVS = 38


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def available() -> bool:
    """Whether this kernel has Landlock (its ABI version answers)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    return (
        int(libc.syscall(_CREATE_RULESET, None, ctypes.c_size_t(0), _CREATE_RULESET_VERSION)) >= 1
    )


def readable_roots(
    denied: Iterable[Path],
    *,
    listdir: Callable[[Path], list[str]] = lambda p: os.listdir(p),
    resolve: Callable[[Path], Path] = lambda p: Path(os.path.realpath(p)),
) -> list[Path]:
    """The paths beneath which everything may be read, so that nothing beneath `denied` may:
    beneath each directory on the way from ``/`` to a denied one, every other entry. `denied`
    are absolute, resolved paths; a denied path inside another counts as the outer one.

    An entry is a rule on what it resolves to: a symbolic link to a directory on the way, or
    into a denied one (pytest's ``pytest-current``, a ``/var/run`` to ``/run``), would open the
    whole of it, so such an entry is left out (what it leads to is covered entry by entry)."""
    blocked = sorted({Path(d) for d in denied}, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for d in blocked:
        if not any(d == k or k in d.parents for k in kept):
            kept.append(d)
    on_the_way = {a for d in kept for a in d.parents}

    def opens_a_way(path: Path) -> bool:
        real = resolve(path)
        return real in on_the_way or any(real == k or k in real.parents for k in kept)

    roots: list[Path] = []
    for directory in sorted(on_the_way, key=lambda p: (len(p.parts), str(p))):
        try:
            entries = listdir(directory)
        except OSError:
            continue
        for name in sorted(entries):
            child = directory / name
            if child in on_the_way or child in kept or opens_a_way(child):
                continue
            roots.append(child)
    return roots


def confine(denied: Sequence[str], allowed: Sequence[str]) -> bool:
    """Confine this process (and all it starts) as the module says; False, changing nothing,
    when the kernel has no Landlock. Denied paths that do not exist deny nothing."""
    if not available():
        return False
    deny = [Path(os.path.realpath(d)) for d in denied if os.path.exists(d)]
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    attr = _RulesetAttr(_ACCESS_READ_FILE)
    ruleset = int(libc.syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.sizeof(attr), 0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        paths = [*readable_roots(deny), *(Path(os.path.realpath(a)) for a in allowed)]
        for path in paths:
            _allow(libc, ruleset, path)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if libc.syscall(_RESTRICT_SELF, ruleset, 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)
    return True


def _allow(libc: ctypes.CDLL, ruleset: int, path: Path) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # gone since it was listed, or a dangling link: nothing to read there
    try:
        rule = _PathBeneathAttr(_ACCESS_READ_FILE, fd)
        if libc.syscall(_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), 0) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {path}")
    finally:
        os.close(fd)


def wrap(argv: Sequence[str], *, denied: Iterable[str], allowed: Iterable[str]) -> list[str]:
    """`argv` run confined: the wrapper's command line (paths only; no secret goes on it)."""
    cmd = [sys.executable, "-m", "ksb.runtime.confinement"]
    for d in denied:
        cmd += ["--deny", str(d)]
    for a in allowed:
        cmd += ["--allow", str(a)]
    return [*cmd, "--", *argv]


def main(args: Sequence[str] | None = None) -> None:
    """``--deny DIR ... --allow FILE ... -- program args...``: confine, then become `program`."""
    given = list(sys.argv[1:] if args is None else args)
    if "--" not in given or given.index("--") == len(given) - 1:
        raise SystemExit(
            "usage: python -m ksb.runtime.confinement [--deny DIR] [--allow FILE] -- program ..."
        )
    split = given.index("--")
    parser = argparse.ArgumentParser(prog="python -m ksb.runtime.confinement")
    parser.add_argument("--deny", action="append", default=[])
    parser.add_argument("--allow", action="append", default=[])
    opts = parser.parse_args(given[:split])
    program = given[split + 1 :]
    if not confine(opts.deny, opts.allow):
        print("ksb.runtime.confinement: no Landlock in this kernel; unconfined", file=sys.stderr)
    os.execvp(program[0], program)


if __name__ == "__main__":
    main()
