#!/usr/bin/env python3
"""Regenerate the Python code of the schema (kvbroker/v1) from proto/.

The generated files are committed and never edited by hand; CI runs this script and fails
on any diff, so the committed code always matches the schema.
"""

from __future__ import annotations

import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT = ROOT  # package path kvbroker/v1 mirrors proto/kvbroker/v1


def main() -> int:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "kvbroker").rglob("*.proto"))
    if not protos:
        print("no .proto files under proto/kvbroker", file=sys.stderr)
        return 1
    include = str(pathlib.Path(protoc.__file__).parent / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={OUT}",
        f"--pyi_out={OUT}",
        f"--grpc_python_out={OUT}",
        *protos,
    ]
    rc = protoc.main(args)
    if rc != 0:
        print(f"protoc failed with exit code {rc}", file=sys.stderr)
        return rc
    for pkg in {pathlib.Path(p).parent for p in protos} | {pathlib.Path("kvbroker")}:
        init = OUT / pkg / "__init__.py"
        if not init.exists():
            init.write_text('"""Generated from proto/ by scripts/gen_proto.py; do not edit."""\n')
    return 0


if __name__ == "__main__":
    sys.exit(main())
