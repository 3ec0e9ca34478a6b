"""Regenerate the gRPC modules in psserver/protocol/proto/ from protos/.

Generated code is never edited by hand; tests/unit/test_codegen.py runs
`generate()` into a temporary folder and fails if the checked-in copy differs.
Usage: python -m psserver.codegen [OUT_ROOT]
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_FILES = ("psserver/protocol/proto/ps.proto", "psserver/protocol/proto/replica.proto")


def generate(out_root: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) for every proto; return the files written."""
    import grpc_tools
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    out_root.mkdir(parents=True, exist_ok=True)
    for proto in PROTO_FILES:
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{PROTO_ROOT}",
                f"-I{include}",
                f"--python_out={out_root}",
                f"--pyi_out={out_root}",
                f"--grpc_python_out={out_root}",
                proto,
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc} on {proto}")
    written = []
    for proto in PROTO_FILES:
        stem = Path(proto).with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            written.append(out_root / f"{stem}{suffix}")
    return written


def main() -> None:
    out_root = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT
    for path in generate(out_root):
        print(path.relative_to(out_root))


if __name__ == "__main__":
    main()
