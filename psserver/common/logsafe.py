"""Quoting client-supplied strings in messages and logs, and keeping repeated refusals from flooding the log.

A client controls every string it sends: a 4 MB trainer id, a newline that
forges a log line, an escape sequence that repaints a terminal.  ``shorten``
is the one way such a string enters a refusal message or a log line: escaped
(nothing but printable ASCII comes out) and cut to a fixed length, saying how
much was cut.  ``RateLimitedLog`` lets the first few refusals of a kind through
and counts the rest; metrics count every refusal, so the log only needs a sample.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Callable

MIN_LIMIT = 32  # room for two quotes, a few characters and "…(+N chars)" with N up to 16 digits

_ESCAPES = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str, quoted: bool) -> str:
    """One character as printable ASCII: as in a Python literal, always single-quoted."""
    if quoted and ch in _ESCAPES:
        return _ESCAPES[ch]
    o = ord(ch)
    if 0x20 <= o < 0x7F:
        return ch
    if ch in "\n\r\t":
        return _ESCAPES[ch]
    if o < 0x100:
        return f"\\x{o:02x}"
    if o < 0x10000:
        return f"\\u{o:04x}"
    return f"\\U{o:08x}"


def shorten(value: object, limit: int = 64) -> str:
    """``value`` as at most ``limit`` printable characters: a string quoted and escaped like a Python
    literal ('rank0\\nforged'), anything else as its escaped repr; what does not fit is cut and
    counted: 'aaaa'…(+3999996 chars).  All is ASCII but that "…" marker (a "…" in the value comes
    out as \\u2026), so a cut is never mistaken for the value.  Work is bounded by ``limit``, not by
    the length of ``value``; an escape is never split.

    Raises:
        ValueError: ``limit`` is below MIN_LIMIT.
    """
    if limit < MIN_LIMIT:
        raise ValueError(f"The limit ({limit}) must be at least {MIN_LIMIT} characters.")
    quoted = isinstance(value, str)
    text = value if quoted else repr(value)
    quote = "'" if quoted else ""
    room = limit - 2 * len(quote)  # for the escaped text when it all fits
    cut_room = room - len(f"…(+{len(text)} chars)")  # for the kept part when it does not
    pieces: list[str] = []
    size, keep = 0, 0
    for i, ch in enumerate(text):
        piece = _escape(ch, quoted)
        if size + len(piece) <= cut_room:
            keep = i + 1
        size += len(piece)
        if size > room:
            return f"{quote}{''.join(pieces[:keep])}{quote}…(+{len(text) - keep} chars)"
        pieces.append(piece)
    return f"{quote}{''.join(pieces)}{quote}"


def counted(n: int, noun: str, plural: str = "") -> str:
    """``1 trainer``, ``2 trainers``: a count and its noun in agreement (every count a person reads)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


class RateLimitedLog:
    """Logs at most ``burst`` messages per key in each window of ``interval`` seconds.

    A window opens with the first message of a key; later messages of that key in the window
    beyond ``burst`` are counted, not logged.  The first message logged after the window closes
    starts with "(N similar messages suppressed in the last X s)".  Keys name a kind of event
    ("register refused: INVALID_ARGUMENT"), never a client-supplied string; at most ``max_keys``
    are remembered (the least recently used is forgotten, with its count).  This limits the log
    only: the caller counts every event in its metrics.  Quote client strings in ``args`` through
    ``shorten``; this class does not.
    """

    MAX_KEY_CHARS = 256  # a longer key is cut, so the table's memory stays bounded

    def __init__(self, logger: logging.Logger, burst: int = 5, interval: float = 10.0, max_keys: int = 1024,
                 clock: Callable[[], float] = time.monotonic):
        if burst < 1:
            raise ValueError(f"The burst ({burst}) must be at least 1.")
        if not interval > 0:
            raise ValueError(f"The interval ({interval} s) must be greater than zero.")
        if max_keys < 1:
            raise ValueError(f"The maximum number of keys ({max_keys}) must be at least 1.")
        self.logger, self.burst, self.interval, self.max_keys, self.clock = logger, burst, interval, max_keys, clock
        self._lock = threading.Lock()  # guards _windows; never held while a handler writes
        self._windows: OrderedDict[str, list] = OrderedDict()  # key -> [window start, logged, suppressed]

    def log(self, level: int, key: str, msg: str, *args) -> bool:
        """Log ``msg % args`` at ``level`` unless the key's burst is spent; True if it was logged."""
        key = key[: self.MAX_KEY_CHARS]
        now = self.clock()
        with self._lock:
            window = self._windows.get(key)
            prefix = ""
            if window is None or now - window[0] >= self.interval:
                if window is not None and window[2]:
                    prefix = f"({window[2]} similar messages suppressed in the last {now - window[0]:.0f} s) "
                window = [now, 0, 0]
                self._windows[key] = window
                while len(self._windows) > self.max_keys:
                    self._windows.popitem(last=False)
            self._windows.move_to_end(key)
            if window[1] >= self.burst:
                window[2] += 1
                return False
            window[1] += 1
        self.logger.log(level, prefix + msg, *args)  # the prefix holds no "%": safe to join to a format
        return True

    def warning(self, key: str, msg: str, *args) -> bool:
        """``log(logging.WARNING, ...)``."""
        return self.log(logging.WARNING, key, msg, *args)

    def suppressed(self, key: str) -> int:
        """Messages of ``key`` suppressed in its current window (0 for an unknown key)."""
        with self._lock:
            window = self._windows.get(key[: self.MAX_KEY_CHARS])
            return window[2] if window else 0
