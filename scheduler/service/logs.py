"""How a worker's processes log: one configuration for the HTTP process and its rank processes.

:func:`configure` sets the root logger's level and format (:class:`LogSettings`, which a
worker's rank processes receive with its :class:`~scheduler.service.config.ServeConfig`, so that
``--log-level`` and ``--log-format`` reach them too). ``text`` is one line per record,
``<time> <LEVEL> [<process> ]<logger>: <message>``; ``json`` is one JSON object per line (for
log collectors) with the keys ``time`` (UTC, ISO 8601 with milliseconds), ``level``,
``logger``, ``message``, ``process`` (a rank process's name, such as ``dp1/rank0``; absent in
the HTTP process) and, for a record with a traceback, ``exception``.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
import types

import attrs

from lifecycle.validators import one_of, typed_fields

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")


@attrs.frozen(field_transformer=typed_fields)
class LogSettings:
    """The level (``--log-level``) and format (``--log-format``) of a worker's logs."""

    level: str = attrs.field(default="info", validator=one_of(LEVELS))
    format: str = attrs.field(default="text", validator=one_of(FORMATS))


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module's documentation)."""

    def __init__(self, process: str | None = None) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line: dict[str, str] = {
            "time": f"{stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.process is not None:
            line["process"] = self.process
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        return json.dumps(line, ensure_ascii=False)


def configure(settings: LogSettings, process: str | None = None) -> None:
    """Log to standard error as ``settings`` say; ``process`` names a rank process in each
    line. Python's warnings go through logging too (logger ``py.warnings``), and with ``json``
    so do exceptions nothing caught, in any thread (logger ``pdlife.uncaught``, CRITICAL): no
    line of the process's own reaches standard error as plain text. A process whose logging is
    configured already (the root logger has handlers: an embedder's, a test runner's) keeps
    it as it is."""
    if logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    if settings.format == "json":
        handler.setFormatter(JsonFormatter(process))
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread
    else:
        name = f"{process} " if process is not None else ""
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s %(levelname)s {name}%(name)s: %(message)s"))
    logging.basicConfig(level=settings.level.upper(), handlers=[handler])
    logging.captureWarnings(True)


_uncaught = logging.getLogger("pdlife.uncaught")


def _log_uncaught(kind: type[BaseException], exc: BaseException,
                  tb: types.TracebackType | None) -> None:
    _uncaught.critical("uncaught %s", kind.__name__, exc_info=(kind, exc, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:  # as threading's own hook: a thread's quiet exit
        return
    name = args.thread.name if args.thread is not None else "?"
    exc = args.exc_value if args.exc_value is not None else args.exc_type()
    _uncaught.critical("uncaught %s in thread %s", args.exc_type.__name__, name,
                       exc_info=(args.exc_type, exc, args.exc_traceback))
