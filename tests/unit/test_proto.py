"""The committed code of the queue service's API is what `make proto` makes of proto/ now: the
Python the SDK and the service import, and the Go of the client in clients/go."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[2]
PROTO = "ksb/api/queue/v1/queue.proto"
GO_API = ROOT / "clients/go/api/queue/v1"
GO_BIN = ROOT / ".cache/go/bin"


def _protoc(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "proto"), *args, PROTO],
        check=True,
        capture_output=True,
    )


def test_the_generated_api_is_current(tmp_path: Path) -> None:
    bin_dir = Path(sys.executable).parent
    _protoc(
        f"--python_out={tmp_path}",
        f"--grpc_python_out={tmp_path}",
        f"--mypy_out={tmp_path}",
        f"--mypy_grpc_out={tmp_path}",
        f"--plugin=protoc-gen-mypy={bin_dir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
    )
    made = sorted((tmp_path / "ksb/api/queue/v1").iterdir())
    assert made, "protoc made nothing"
    for path in made:
        committed = ROOT / "shared/ksb/api/queue/v1" / path.name
        assert committed.read_bytes() == path.read_bytes(), f"{path.name}: run `make proto`"


def _go_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """The descriptor the committed Go code embeds (its ``rawDesc`` string constant)."""
    source = (GO_API / "queue.pb.go").read_text()
    found = re.search(r'_rawDesc = ""((?: \+\n\t"(?:[^"\\]|\\.)*")+)\n', source)
    assert found is not None, "queue.pb.go: no rawDesc constant"
    pieces = re.findall(r'"((?:[^"\\]|\\.)*)"', found.group(1))
    raw = b"".join(ast.literal_eval(f'b"{p}"') for p in pieces)
    return descriptor_pb2.FileDescriptorProto.FromString(raw)


def test_the_generated_go_describes_the_proto_as_it_is(tmp_path: Path) -> None:
    """Cheap, and needs no Go: every message, field and method the Go code was made from is
    the proto's now (the descriptor protoc makes of it)."""
    _protoc(f"--descriptor_set_out={tmp_path / 'set.pb'}")
    [fresh] = descriptor_pb2.FileDescriptorSet.FromString((tmp_path / "set.pb").read_bytes()).file
    go = _go_descriptor()
    for described in (go, fresh):  # the JSON names: derived, and left out by some protocs
        for message in described.message_type:
            for field in message.field:
                field.ClearField("json_name")
    assert go == fresh, "clients/go/api is not the proto's: run `make proto`"


def test_the_generated_go_is_what_make_proto_makes(tmp_path: Path) -> None:
    """The whole Go code, comments included, when the pinned plugins are installed (`make
    proto` installs them into .cache/go/bin)."""
    makefile = (ROOT / "Makefile").read_text()
    pins = dict(re.findall(r"^(PROTOC_GEN_GO(?:_GRPC)?_VERSION) := (\S+)$", makefile, re.M))
    stamp = GO_BIN / (
        f".plugins-{pins['PROTOC_GEN_GO_VERSION']}-{pins['PROTOC_GEN_GO_GRPC_VERSION']}"
    )
    if not stamp.exists():
        pytest.skip("the Go protoc plugins are not installed (`make proto` installs them)")
    package = "Mksb/api/queue/v1/queue.proto=ksb/clients/go/api/queue/v1;queuev1"
    assert package in makefile
    _protoc(
        f"--plugin=protoc-gen-go={GO_BIN / 'protoc-gen-go'}",
        f"--plugin=protoc-gen-go-grpc={GO_BIN / 'protoc-gen-go-grpc'}",
        f"--go_out={tmp_path}",
        f"--go_opt=module=ksb/clients/go,{package}",
        f"--go-grpc_out={tmp_path}",
        f"--go-grpc_opt=module=ksb/clients/go,{package}",
    )
    made = sorted((tmp_path / "api/queue/v1").iterdir())
    assert [p.name for p in made] == sorted(p.name for p in GO_API.iterdir())
    for path in made:
        committed = GO_API / path.name
        assert committed.read_bytes() == path.read_bytes(), f"{path.name}: run `make proto`"
