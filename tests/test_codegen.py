"""Every committed protobuf module is what protoc makes of its proto today."""

from __future__ import annotations

from pathlib import Path

from podgate import codegen


def test_generated_modules_are_fresh(tmp_path: Path) -> None:
    written = codegen.generate(tmp_path)
    assert len(written) == sum(len(m.generated()) for m in codegen.PROTOS)
    for path in written:
        committed = codegen.SOURCE_ROOT / path.relative_to(tmp_path)
        assert path.read_bytes() == committed.read_bytes(), (
            f"{committed.name} is stale: run python -m podgate.codegen"
        )
