"""Structured, quiet-by-default logging for the daemon and the CLI.

One line per event: ``text`` is ``time level logger: message key=value ...``,
``json`` one JSON object per line. Structured fields are passed with
``extra={"fields": {...}}``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = getattr(record, "fields", {})
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        extra = "".join(f" {k}={v}" for k, v in fields.items())
        line = f"{stamp} {record.levelname.lower()} {record.name}: {record.getMessage()}{extra}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """Routes the ``dataquay`` loggers to stderr in the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    root = logging.getLogger("dataquay")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
