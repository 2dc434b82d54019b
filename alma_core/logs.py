"""Logging set-up: JSON lines for machines, a compact format for terminals.

Log calls carry a stable ``extra={"action": ...}`` plus ids (``run_id``,
``event_id``, ``consumer``, ``partition``); both formats print them.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from datetime import UTC, datetime
from typing import Any

from alma_core import tracing

# user:password@ in a URL, and password=... in a key/value DSN or a connection error
_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*):[^@\s]*@")
_KV_PASSWORD = re.compile(
    r"(?i)(?P<head>\bpass(?:word)?\s*[=:]\s*)(?:'[^']*'|\"[^\"]*\"|[^\s,;&]+)"
)


def redact(text: str) -> str:
    """``text`` with every password masked: ``postgresql://alma:***@host/db``,
    ``password=***``. Every log line and every error the command line prints goes
    through it, so a DSN in a driver's error message does not leak either."""
    text = _URL_PASSWORD.sub(r"\g<head>:***@", text)
    return _KV_PASSWORD.sub(r"\g<head>***", text)


_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


class TraceIds(logging.Filter):
    """Puts the current span's ``trace_id`` and ``span_id`` on each record logged while
    a span is current (a traced batch, a traced SDK call), so a log line leads to its
    trace and a trace to its log lines; nothing when tracing is off."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "trace_id" not in record.__dict__:
            for key, value in tracing.current_ids().items():
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **_extras(record),
        }
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return redact(json.dumps(doc, default=str))


class ConsoleFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(self._format(record))

    def _format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created).strftime("%H:%M:%S")
        extras = " ".join(f"{k}={v}" for k, v in _extras(record).items())
        line = f"{ts} {record.levelname:<7} {record.name}: {record.getMessage()}"
        if extras:
            line += f"  [{extras}]"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure(fmt: str = "console", level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else ConsoleFormatter())
    handler.addFilter(TraceIds())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # aiokafka logs every failed connection attempt at ERROR; our own retries say more.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL if level != "DEBUG" else logging.DEBUG)
