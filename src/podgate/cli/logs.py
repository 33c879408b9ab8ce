"""Logging for podgate's commands: text for people, JSON lines for machines.

Ids and figures travel as fields: `log.info("stream ended", extra={"pod": ..., "port": ...,
"duration_s": ...})` gives JSON keys of their own, and `key=value` pairs after the message in
text.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

# What every LogRecord has; anything else on a record came in through `extra=`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The `extra=` fields of a record, in the order they were given."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record_fields(record).items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = record_fields(record)
        if not fields:
            return text
        head, sep, tail = text.partition("\n")  # fields before any traceback
        pairs = " ".join(f"{k}={v}" for k, v in fields.items())
        return f"{head} {pairs}{sep}{tail}"


def setup_logging(fmt: str = "text", verbose: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
