"""The checked-in generated gRPC code is exactly what protos/ generates."""

from pathlib import Path

from psserver.codegen import REPO_ROOT, generate


def test_generated_code_matches_protos(tmp_path: Path):
    written = generate(tmp_path)
    assert written
    for path in written:
        rel = path.relative_to(tmp_path)
        checked_in = REPO_ROOT / rel
        assert checked_in.exists(), f"{rel} is missing: run python -m psserver.codegen"
        assert checked_in.read_text() == path.read_text(), f"{rel} drifted from protos/: run python -m psserver.codegen"
