"""A bounded slice of `make fuzz`: every parser target on FUZZ_SLICE_INPUTS generated inputs
(random bytes and mutations of a valid exchange). Only protocol errors may come out; a hang
is caught by the test timeout."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from targets import TARGETS, seeds

FUZZ_SLICE_INPUTS = 2000
# Mutations applied to a seed per generated input, at most.
MAX_MUTATIONS = 8


def mutate(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, MAX_MUTATIONS)):
        op = rng.randrange(4)
        pos = rng.randrange(len(out) + 1)
        if op == 0 and out:
            out[min(pos, len(out) - 1)] = rng.randrange(256)
        elif op == 1:
            out[pos:pos] = rng.randbytes(rng.randint(1, 16))
        elif op == 2 and out:
            del out[pos : pos + rng.randint(1, 16)]
        else:
            # Interesting integers where lengths and ids live.
            value = rng.choice([0, 1, 0x7F, 0x80, 0xFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF])
            out[pos:pos] = value.to_bytes(4, "big")
    return bytes(out)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_parser_survives_generated_input(name: str) -> None:
    target = TARGETS[name]
    corpus = seeds()[name]
    rng = random.Random(name)
    for seed in corpus:
        target(seed)
    for i in range(FUZZ_SLICE_INPUTS):
        target(mutate(rng, rng.choice(corpus)) if i % 2 else rng.randbytes(rng.randint(0, 512)))
