"""Log output of `queued serve`: human lines, or one JSON object per line.

Text lines are `time LEVEL logger: message`. With `--log-format json`
(python-json-logger) each record is one object with `time` (ISO 8601, UTC),
`level`, `logger`, `message`, `exc_info` when there is a traceback, and the
record's structured fields: events the operator may alert on carry `event`
("ready", "recovered", "recovery_truncate", "recovery_quarantine", "disk_low", ...)
plus their figures (`cut_bytes`, `free_bytes`, ...).
"""

from __future__ import annotations

import logging
from typing import TextIO

from pythonjsonlogger.json import JsonFormatter

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def formatter(log_format: str) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter(
            "%(levelname)s %(name)s %(message)s",
            rename_fields={"levelname": "level", "name": "logger"},
            timestamp="time",
        )
    return logging.Formatter(TEXT_FORMAT)


def setup_logging(level: str, log_format: str, stream: TextIO) -> None:
    """Send every `queued` log record at `level` or above to `stream`."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter(log_format))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
