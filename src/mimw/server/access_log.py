"""uvicorn's access log without query strings.

uvicorn logs every request line with its query string (``GET /v1/models?api_key=... HTTP/1.1``); clients put keys and
tokens there, so the log would keep them. ``QueryRedactor`` replaces the query part of each access-log record with
``?<redacted>`` before any handler formats it; the path stays, for debugging.
"""
from __future__ import annotations

import logging

ACCESS_LOGGER = "uvicorn.access"
REDACTED = "?<redacted>"


class QueryRedactor(logging.Filter):
    """A filter for uvicorn's access logger, whose records carry (client, method, path?query, http version,
    status) as ``args``."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (args[0], args[1], args[2].split("?", 1)[0] + REDACTED, *args[3:])
        return True


def redact_access_log(logger: logging.Logger | None = None) -> None:
    """Install the filter on uvicorn's access logger (once; call it after ``uvicorn.Config`` set up logging)."""
    logger = logger or logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, QueryRedactor) for f in logger.filters):
        logger.addFilter(QueryRedactor())
