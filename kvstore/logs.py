"""kvstore's log lines: one format for kvstore's own lines, uvicorn's and the
access log, as text or as one JSON object a line (``server.log_format``).

Both formats carry the same fields: time, level, logger, message, the
worker where a supervised set runs (docs/workers.md), and for an access line
(the ``kvstore.access`` logger, one line per request at INFO,
``server.access_log``) the request's method, path, status, octets in and
out, duration, principal and peer. A message is written for a person: an
exception is described (:func:`describe`), not shown as its ``repr``.

Events that come in bursts (a tier that lost its data, each of its blocks
found missing as it is read) are logged as one line with a count
(:class:`Tally`), not one line each.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

#: The access log's logger: one INFO line per request (kvstore.metrics).
ACCESS = "kvstore.access"

#: An access line's fields, in its ``access`` tuple's order.
ACCESS_FIELDS = (
    "method",
    "path",
    "status",
    "octets_in",
    "octets_out",
    "duration_ms",
    "principal",
    "peer",
)

#: The access line's text: the same fields, in the same order.
ACCESS_TEXT = "%s %s %d in=%d out=%d %.1fms principal=%s peer=%s"

FORMATS = ("text", "json")


def describe(exc: BaseException) -> str:
    """An exception as a sentence for a log line or an error's detail: its
    message, with what kind of failure it is where the message alone does
    not say (never a ``repr`` with constructor syntax)."""
    connect = _connect_failure(exc)
    if connect is not None:
        return connect
    text = str(exc).strip()
    if isinstance(exc, TimeoutError):
        return f"timed out ({text})" if text else "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror}{where}"
    if type(exc).__module__.startswith("kvstore"):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _connect_failure(exc: BaseException) -> str | None:
    """aiohttp's ClientConnectorError (and its TLS kinds) as "cannot connect
    to host:port: reason"; None for anything else."""
    host, port = getattr(exc, "host", None), getattr(exc, "port", None)
    os_error = getattr(exc, "os_error", None)
    if host is None or port is None or not isinstance(os_error, OSError):
        return None
    reason = os_error.strerror or str(os_error) or type(os_error).__name__
    if isinstance(os_error, ConnectionRefusedError):
        reason = "connection refused"
    return f"cannot connect to {host}:{port}: {reason}"


class TextFormatter(logging.Formatter):
    """``time LEVEL logger [worker i] message`` (an access line's fields are
    in its message)."""

    def __init__(self, worker: int | None = None) -> None:
        who = f"[worker {worker}] " if worker is not None else ""
        super().__init__(f"%(asctime)s %(levelname)s %(name)s {who}%(message)s")


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, RFC 3339), level, logger, message,
    worker, an access line's fields by name, and an exception's traceback
    as ``exception``."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        seconds = time.gmtime(record.created)
        millis = int(record.msecs)
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", seconds) + f".{millis:03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.worker is not None:
            line["worker"] = self.worker
        access = getattr(record, "access", None)
        if access is not None:
            line.update(zip(ACCESS_FIELDS, access, strict=True))
            line["duration_ms"] = round(line["duration_ms"], 3)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def formatter(log_format: str, worker: int | None = None) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter(worker)
    return TextFormatter(worker)


def setup(
    level: str = "info",
    log_format: str = "text",
    access_log: bool = True,
    worker: int | None = None,
) -> None:
    """Every line of the process through one handler on standard error in
    ``log_format``: kvstore's own at ``level``, the access log at INFO
    unless turned off, other libraries' (uvicorn's included) at WARNING."""
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(log_format, worker))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("kvstore").setLevel(level.upper())
    # The access log at INFO when on (below kvstore's level it is not written:
    # log_level = "warning" quiets it too); off, it is not even formatted.
    access = logging.getLogger(ACCESS)
    access.setLevel(logging.NOTSET if access_log else logging.WARNING)
    # uvicorn's loggers come through the root handler (uvicorn.Config with
    # log_config=None adds none of its own); its access log is ours.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "asyncio"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate, logger.disabled = True, False
        logger.setLevel(logging.NOTSET)  # (uvicorn.Config sets its own after)


class Tally:
    """Events of one kind, per subject (a tier), logged as one line with a
    count: the first at once, those that follow within ``window_s`` as one
    line when the window ends. ``message`` is formatted with the subject
    and the count (``"tier %s lost the segments of %d blocks"``)."""

    def __init__(
        self,
        logger: logging.Logger,
        message: str,
        level: int = logging.WARNING,
        window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger, self.message, self.level = logger, message, level
        self.window_s, self.clock = window_s, clock
        #: subject -> (the window's end, events not logged yet)
        self._open: dict[str, tuple[float, int]] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        #: Every event counted, by subject.
        self.counts: dict[str, int] = {}

    def __call__(self, subject: str, detail: str = "") -> None:
        self.counts[subject] = self.counts.get(subject, 0) + 1
        now = self.clock()
        window = self._open.get(subject)
        if window is not None and now < window[0]:
            self._open[subject] = (window[0], window[1] + 1)
            self._flush_later(subject, window[0] - now)
            return
        if window is not None and window[1]:
            self._emit(subject, window[1], "")
        self._open[subject] = (now + self.window_s, 0)
        self._emit(subject, 1, detail)

    def flush(self) -> None:
        """Log what is counted and not logged yet (at a stop)."""
        for timer in self._timers.values():
            timer.cancel()
        for subject in list(self._open):
            self._flush(subject)

    def _flush_later(self, subject: str, delay: float) -> None:
        if subject in self._timers:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop: the next event, or flush(), logs the count
        self._timers[subject] = loop.call_later(delay, self._flush, subject)

    def _flush(self, subject: str) -> None:
        self._timers.pop(subject, None)
        window = self._open.get(subject)
        if window is not None and window[1]:
            self._open[subject] = (window[0], 0)
            self._emit(subject, window[1], "")

    def _emit(self, subject: str, count: int, detail: str) -> None:
        extra = f": {detail}" if detail else ""
        self.logger.log(self.level, self.message + "%s", subject, count, extra)
