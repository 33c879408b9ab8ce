"""Log lines carry ids and figures as fields: JSON keys, or key=value pairs in text."""

from __future__ import annotations

import json
import logging

from podgate.cli.logs import JsonFormatter, TextFormatter


def record(**extra: object) -> logging.LogRecord:
    logger = logging.getLogger("podgate.test")
    rec = logger.makeRecord(
        "podgate.test", logging.INFO, __file__, 1, "stream %s ended", ("7",), None
    )
    for key, value in extra.items():
        setattr(rec, key, value)
    return rec


def test_json_lines_have_the_extra_fields() -> None:
    line = JsonFormatter().format(record(pod="default/hello", port=8080, duration_s=1.5))
    entry = json.loads(line)
    assert entry["msg"] == "stream 7 ended"
    assert (entry["pod"], entry["port"], entry["duration_s"]) == ("default/hello", 8080, 1.5)
    assert entry["level"] == "info" and entry["logger"] == "podgate.test"


def test_json_fields_never_replace_the_standard_keys() -> None:
    entry = json.loads(JsonFormatter().format(record(level="forged")))
    assert entry["level"] == "info"


def test_text_lines_end_with_key_value_pairs() -> None:
    line = TextFormatter().format(record(pod="default/hello", port=8080))
    assert line.endswith("podgate.test: stream 7 ended pod=default/hello port=8080")


def test_a_plain_record_has_no_fields() -> None:
    assert TextFormatter().format(record()).endswith("podgate.test: stream 7 ended")
