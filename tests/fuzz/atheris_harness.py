"""Coverage-guided fuzzing of one decoder with atheris (libFuzzer), held to `tests.fuzz.contract`.

    python -m tests.fuzz.atheris_harness TARGET [libFuzzer options] [CORPUS_DIR ...]

TARGET is a name in `tests.fuzz.targets.TARGETS`. KSB's modules and the parsers under them (PyYAML,
lark, jsonschema) are instrumented, so libFuzzer keeps the inputs that reach new branches of
them. An input that breaks the contract does not stop the run: it is written to the findings
directory (``FUZZ_FINDINGS``, default ``var/fuzz/findings/TARGET``) once per distinct failure
(the exception's type and the innermost frame that raised it), with its traceback, once
`tests.fuzz.replay` has reproduced it uninstrumented, and the run goes on, so one run reports
every distinct failure it meets. `tests.fuzz.run_atheris` runs each
target this way and sums up.
"""

from __future__ import annotations

import gc
import hashlib
import os
import subprocess
import sys
import traceback
import types
from pathlib import Path

import atheris

from tests.fuzz.contract import ContractViolation
from tests.fuzz.targets import TARGETS

__all__ = ["main"]


def _signature(violation: ContractViolation) -> str:
    """What makes two failures the same: the exception's type and where it was raised."""
    cause = violation.__cause__
    if cause is None:  # out of CPU time, or an empty reason
        return str(violation)[:80]
    frames = traceback.extract_tb(cause.__traceback__)
    where = frames[-1] if frames else None
    place = f"{Path(where.filename).name}:{where.lineno}" if where else "?"
    return f"{type(cause).__name__}@{place}"


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: {sys.argv[0]} TARGET [libFuzzer options]; targets: {', '.join(TARGETS)}")
    target = TARGETS[sys.argv[1]]
    findings = Path(os.environ.get("FUZZ_FINDINGS", f"var/fuzz/findings/{target.name}"))
    findings.mkdir(parents=True, exist_ok=True)
    seen = {p.stem for p in findings.glob("*.txt")}

    def one_input(data: bytes) -> None:
        try:
            target.run(data)
        except ContractViolation as violation:
            signature = _signature(violation)
            name = hashlib.sha1(signature.encode()).hexdigest()[:12]
            if name in seen:
                return
            seen.add(name)
            (findings / f"{name}.input").write_bytes(data)
            if not _confirmed(target.name, findings / f"{name}.input"):
                (findings / f"{name}.input").rename(findings / f"{name}.unconfirmed")
                print(f"UNCONFIRMED {target.name} {signature}", file=sys.stderr, flush=True)
                return
            (findings / f"{name}.txt").write_text(
                f"{signature}\n{violation}\n\n"
                + "".join(traceback.format_exception(violation))
                + f"\ninput: {data[:2000]!r}\n"
            )
            print(f"FINDING {target.name} {signature}: {violation}", file=sys.stderr, flush=True)

    _instrument()
    atheris.Setup([sys.argv[0], *sys.argv[2:]], one_input)
    atheris.Fuzz()


def _confirmed(target: str, path: Path) -> bool:
    """Whether the input breaks the contract uninstrumented too (`tests.fuzz.replay`)."""
    replay = subprocess.run(
        [sys.executable, "-m", "tests.fuzz.replay", target, str(path)],
        capture_output=True,
        timeout=120,
    )
    return replay.returncode != 0


_INSTRUMENTED = ("ksb", "yaml", "lark", "jsonschema", "json", "base64", "tests.fuzz")


def _instrument() -> None:
    """Instrument the Python code the decoders run (KSB, PyYAML, lark, jsonschema) for coverage.

    `atheris.instrument_imports` misses modules that an editable install's finder loads (KSB is
    installed so), and `atheris.instrument_all` takes minutes over everything loaded, so the
    functions of these packages are instrumented once loaded. pydantic-core's validators are
    native code: for the record decoders libFuzzer sees little more than the Python around them
    and works mostly as a mutator of the real seed records.
    """
    for obj in gc.get_objects():
        if (
            isinstance(obj, types.FunctionType)
            and isinstance(obj.__module__, str)
            and any(
                obj.__module__ == p or obj.__module__.startswith(p + ".") for p in _INSTRUMENTED
            )
        ):
            try:
                atheris.instrument_func(obj)
            except Exception as exc:  # a function atheris cannot patch stays as it is
                print(f"not instrumented: {obj.__qualname__}: {exc}", file=sys.stderr)


if __name__ == "__main__":
    main()
