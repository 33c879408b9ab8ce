"""Coverage-guided fuzzing of one target with atheris (libFuzzer): `make fuzz` runs every
target for FUZZ_RUNS inputs. Usage: run_atheris.py TARGET CORPUS_DIR [libFuzzer flags];
`run_atheris.py --list` names the targets. The caller owns (and removes) CORPUS_DIR."""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).parent))

with atheris.instrument_imports(include=["podgate.proto", "wsproto", "h11"]):
    from targets import TARGETS, seeds


def main() -> None:
    if sys.argv[1:] == ["--list"]:
        print(" ".join(sorted(TARGETS)))
        return
    name, corpus, flags = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    target = TARGETS[name]
    corpus.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(seeds()[name]):
        (corpus / f"seed{i}").write_bytes(seed)
    atheris.Setup([sys.argv[0], *flags, str(corpus)], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
