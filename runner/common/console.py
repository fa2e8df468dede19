"""The console's log lines (conf/hydra/job_logging/runner.yaml): short, and as wide
as a terminal holds.

Hydra's own format puts ``[2026-11-28 00:24:21,377][runner.data.sources.synthetic][INFO] - `` before
every message; on the console a message stands alone (a warning or an error says so in one
word), while the run folder's ``runner.log`` keeps the timestamp, the logger and the level.
On a terminal, a message longer than its width (at most ``WIDTH`` columns) is wrapped at
spaces, its further lines indented; a word longer than that (a path) is never cut, so it
can be copied. Written to a file or a pipe, each record stays one line, for ``grep``. An
error is always one line (``error: ...``): the one line a user's mistake gets.
"""

from __future__ import annotations

import logging
import os
import sys
import textwrap
from typing import IO

WIDTH = 100  # the widest a wrapped line gets, on a wider terminal too
NARROWEST = 40  # a terminal narrower than this is wrapped at this width


def terminal_columns(stream: IO[str] | None) -> int | None:
    """The width of the terminal ``stream`` writes to; None when it is not a terminal."""
    try:
        if stream is None or not stream.isatty():
            return None
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):  # closed, or no file descriptor
        return None


class ConsoleFormatter(logging.Formatter):
    """A record as the console shows it: ``message`` (INFO and below), ``warning: message``,
    ``error: message``; wrapped to the terminal when ``stream`` (default: ``sys.stdout``
    at the time of writing, where Hydra's console handler writes) is one."""

    def __init__(self, stream: IO[str] | None = None, width: int = WIDTH):
        super().__init__("%(message)s")
        self.stream, self.width = stream, width

    def columns(self) -> int | None:
        """Where to wrap, or None (not a terminal: one line per record)."""
        columns = terminal_columns(self.stream or sys.stdout)
        return None if columns is None else max(min(columns, self.width), NARROWEST)

    @staticmethod
    def lead(record: logging.LogRecord) -> str:
        if record.levelno >= logging.ERROR:
            return "" if record.message.startswith("error:") else "error: "
        return "warning: " if record.levelno >= logging.WARNING else ""

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        text = self.lead(record) + record.message
        columns = self.columns()
        if columns is not None and record.levelno < logging.ERROR:
            text = "\n".join(textwrap.fill(line, columns, subsequent_indent="  ",
                                           break_long_words=False, break_on_hyphens=False)
                             for line in text.splitlines())
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            text += "\n" + record.exc_text
        if record.stack_info:
            text += "\n" + self.formatStack(record.stack_info)
        return text
