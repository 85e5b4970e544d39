"""Rate limits of one transport: a token bucket, and a log that a flood cannot flood.

Threading: not thread-safe; each instance belongs to one hub and is used only from its driver
thread. Times are ``time.monotonic()`` seconds passed in by the caller, so nothing here reads
a clock of its own.

Pure Python: importing this module never imports zmq.
"""

from __future__ import annotations

import logging

__all__ = ["LogLimiter", "TokenBucket"]


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved up; starts full at ``now``."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self._rate = rate
        self._burst = burst
        self._tokens = burst
        self._stamp = now

    def take(self, now: float) -> bool:
        """Spend one token if there is one; False (nothing spent) when the bucket is empty."""
        self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True


class LogLimiter:
    """At most ``burst`` lines at once and ``burst`` per ``window`` seconds on average; lines
    beyond that are dropped and counted, and one summary line ("suppressed K similar
    warnings") reports them at most once per ``window``: on the next line logged after the
    window, or from :meth:`flush`, which the owner calls periodically so the summary also
    appears once the flood has stopped. Lines below the logger's level cost nothing and use
    no budget."""

    def __init__(self, logger: logging.Logger, burst: int, window: float, now: float) -> None:
        self._log = logger
        self._window = window
        self._bucket = TokenBucket(burst / window, burst, now)
        self._suppressed = 0
        self._since = now  # when the first line the next summary counts was suppressed

    def log(self, now: float, level: int, msg: str, *args: object) -> None:
        if not self._log.isEnabledFor(level):
            return
        self.flush(now)
        if self._bucket.take(now):
            self._log.log(level, msg, *args)
        else:
            if not self._suppressed:
                self._since = now
            self._suppressed += 1

    def flush(self, now: float) -> None:
        """Log the summary of suppressed lines if there are any and a window has passed."""
        if not self._suppressed or now - self._since < self._window:
            return
        self._log.warning("suppressed %d similar zmq control transport warnings in the last "
                          "%.0f s (a flood of hostile or failing connections? the counters "
                          "are in stats())", self._suppressed, now - self._since)
        self._suppressed = 0
