"""The package's default log output: warnings on stderr until the application configures logging.

A library that only adds a ``NullHandler`` keeps every warning out of sight of a user who never
configured logging: a dump dir where every write fails, a replay of other prompts, an entry
recorded by a run with other settings would pass in silence. The standard library prints such
records through its last-resort handler, but only when no handler at all is found on the way to the
root logger, and a ``NullHandler`` counts as one. :class:`FallbackHandler` takes the last resort's
place for stepskip's loggers: it prints a WARNING (or worse) record once, and only when no other
handler would see it, so configuring logging in any way (``logging.basicConfig`` before or after
importing stepskip, a handler on ``stepskip``, pytest's capture) turns it off without duplicates.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

__all__ = ["FallbackHandler", "install_fallback"]


class FallbackHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes WARNING and above to the current ``sys.stderr`` when no other handler would get the record.

    Example:
        >>> import logging
        >>> handler = FallbackHandler()
        >>> handler.level == logging.WARNING
        True
    """

    def __init__(self) -> None:
        super().__init__()
        self.setLevel(logging.WARNING)
        self.setFormatter(logging.Formatter(logging.BASIC_FORMAT))

    @property
    def stream(self) -> TextIO:
        # looked up at each record, as the standard library's last resort does: a redirected or
        # replaced stderr (a test's capture, a daemonised process) gets the message
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass  # StreamHandler.__init__ sets it; the live sys.stderr is used instead

    def handle(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.level or self._heard_elsewhere(record):
            return False
        return super().handle(record)

    def _heard_elsewhere(self, record: logging.LogRecord) -> bool:
        """True when a handler other than this one is on the record's way up (the way
        ``Logger.callHandlers`` walks it), whatever that handler's level: the application has
        chosen where log records go."""
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(handler is not self for handler in logger.handlers):
                return True
            if not logger.propagate:
                return False
            logger = logger.parent
        return False


def install_fallback(name: str) -> None:
    """Give logger ``name`` a :class:`FallbackHandler` (once, however often it is called)."""
    logger = logging.getLogger(name)
    if not any(isinstance(handler, FallbackHandler) for handler in logger.handlers):
        logger.addHandler(FallbackHandler())
