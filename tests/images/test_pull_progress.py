"""Pull progress in the log: when lines are written and the fields they carry."""

from __future__ import annotations

import json
import logging

from podgate.cli.logs import JsonFormatter
from podgate.images.manifests import Descriptor
from podgate.images.pull import PROGRESS_LOG_INTERVAL_SECONDS, LogProgress

DIGESTS = ["sha256:" + c * 64 for c in "ab"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_progress_lines_and_their_fields() -> None:
    logger = logging.getLogger("test.pull.progress")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    capture = Capture()
    logger.addHandler(capture)
    clock = Clock()
    progress = LogProgress(logger, clock)
    layers = [Descriptor("x", DIGESTS[0], 1000), Descriptor("x", DIGESTS[1], 3000)]
    progress.resolved("r.io/app:v1", "sha256:" + "c" * 64, layers)
    progress.advanced(DIGESTS[0], 500)
    assert len(capture.records) == 1  # within the interval: no line per chunk
    clock.now += PROGRESS_LOG_INTERVAL_SECONDS
    progress.advanced(DIGESTS[1], 1500)
    assert len(capture.records) == 2
    progress.advanced(DIGESTS[0], 500)
    progress.layer_done(DIGESTS[0], cached=False)
    progress.unpacking()
    assert len(capture.records) == 4
    entry = json.loads(JsonFormatter().format(capture.records[-1]))
    assert entry["msg"] == "pull r.io/app:v1: unpacking (1/2 layers, 2500/4000 bytes)"
    assert entry["image"] == "r.io/app:v1"
    assert (entry["layers_done"], entry["layers"]) == (1, 2)
    assert (entry["bytes_done"], entry["bytes"]) == (2500, 4000)
    assert entry["seconds"] == PROGRESS_LOG_INTERVAL_SECONDS
    logger.removeHandler(capture)
