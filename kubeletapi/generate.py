"""Generate the Python stubs for the .proto files in this directory.

The files are ``deviceplugin.proto`` (kubelet device plugin API v1beta1),
``podresources.proto`` (kubelet PodResources API v1), ``dra.proto`` (the kubelet's
DRA plugin service v1) and ``pluginregistration.proto`` (kubelet plugin registration
v1). Each ``NAME.proto`` gives ``NAME_pb2.py``, ``NAME_pb2.pyi`` and ``NAME_pb2_grpc.py``.

Run ``python -m kubeletapi.generate`` after editing a .proto and commit
the result. tests/plugin/test_proto_stubs.py calls :func:`generate` into a temp dir and
fails when the committed stubs differ, so the two never drift apart.

protoc writes ``import NAME_pb2`` into the gRPC module, which only works when
this directory is on ``sys.path``. We rewrite it to a package-relative import so
``from kubeletapi import deviceplugin_pb2_grpc`` works.
The type stubs get a ``# ruff: noqa`` line: they are protoc's style, not ours, and
the lint config only excludes the generated ``.py`` files.
"""

from __future__ import annotations

import argparse
import importlib.resources
import re
from pathlib import Path

API_DIR = Path(__file__).resolve().parent
DEVICEPLUGIN_PROTO = API_DIR / "deviceplugin.proto"
PODRESOURCES_PROTO = API_DIR / "podresources.proto"
DRA_PROTO = API_DIR / "dra.proto"
PLUGINREGISTRATION_PROTO = API_DIR / "pluginregistration.proto"
PROTOS = (DEVICEPLUGIN_PROTO, PODRESOURCES_PROTO, DRA_PROTO, PLUGINREGISTRATION_PROTO)

_BARE_IMPORT = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)


class GenerationError(RuntimeError):
    pass


def protoc(args: list[str]) -> None:
    """Run the protoc bundled with grpcio-tools in-process (no PATH lookup)."""
    from grpc_tools import protoc as grpc_protoc

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    code = grpc_protoc.main(["protoc", f"-I{well_known}", *args])
    if code != 0:
        raise GenerationError(f"protoc failed (exit {code}) for arguments {args}")


def stub_names(proto: Path) -> tuple[str, str, str]:
    """The three files generated from ``proto``: message module, type stub, gRPC module."""
    stem = Path(proto).stem
    return (f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py")


def generate_one(out_dir: Path, proto: Path) -> list[Path]:
    """Write the three stub files for ``proto`` into ``out_dir``; return their paths."""
    out_dir = Path(out_dir)
    proto = Path(proto)
    out_dir.mkdir(parents=True, exist_ok=True)
    protoc(
        [
            f"-I{proto.parent}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            proto.name,
        ]
    )
    module, stub_name, grpc_name = stub_names(proto)
    grpc_file = out_dir / grpc_name
    text = grpc_file.read_text()
    fixed, count = _BARE_IMPORT.subn(r"from . import \1 as \2", text)
    if count != 1:
        raise GenerationError(
            f"expected one bare '_pb2' import in {grpc_file}, found {count}; "
            "check the protoc output and update generate.py"
        )
    grpc_file.write_text(fixed)
    stub = out_dir / stub_name
    stub.write_text("# ruff: noqa\n" + stub.read_text())
    return [out_dir / name for name in (module, stub_name, grpc_name)]


def generate(out_dir: Path, protos: tuple[Path, ...] = PROTOS) -> list[Path]:
    """Write the stubs for every proto in ``protos`` into ``out_dir``; return their paths."""
    return [path for proto in protos for path in generate_one(out_dir, proto)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=API_DIR, help="output dir (default: here)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
