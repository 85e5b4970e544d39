"""Rate limits: a token bucket, and a log that a flood cannot flood (hostile connections
at a transport, requests naming thousands of peers at a tier).

Threading: not thread-safe; each instance belongs to one owner (a zmq hub, a tier) and is
used only from its driver thread. Times are ``time.monotonic()`` seconds passed in by the
caller, so nothing here reads a clock of its own.
"""

from __future__ import annotations

import logging


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

    def put_back(self) -> None:
        """Return a token :meth:`take` spent (never above ``burst``)."""
        self._tokens = min(self._burst, self._tokens + 1.0)

    def wait(self, now: float) -> float:
        """Seconds from ``now`` until :meth:`take` can spend a token (0.0: at once)."""
        missing = 1.0 - (self._tokens + (now - self._stamp) * self._rate)
        return max(0.0, missing / self._rate)


class LogLimiter:
    """At most ``burst`` lines at once and ``burst`` per ``window`` seconds on average; lines
    beyond that are dropped and counted, and one summary line ("suppressed K similar
    ``what``") reports them at most once per ``window``: on the next line logged after the
    window, or from :meth:`flush`, which the owner calls periodically so the summary also
    appears once the flood has stopped. Lines below the logger's level cost nothing and use
    no budget."""

    def __init__(
        self, logger: logging.Logger, burst: int, window: float, now: float, what: str
    ) -> None:
        self._log = logger
        self._what = what
        self._window = window
        self._bucket = TokenBucket(burst / window, burst, now)
        self._suppressed = 0
        self._since = now  # when the first line the next summary counts was suppressed

    def log(
        self, now: float, level: int, msg: str, *args: object, logger: logging.Logger | None = None
    ) -> None:
        """Log ``msg % args`` within the budget, to ``logger`` (default: the limiter's own,
        which the summary line always goes to)."""
        target = self._log if logger is None else logger
        if not target.isEnabledFor(level):
            return
        self.flush(now)
        if self._bucket.take(now):
            target.log(level, msg, *args)
        else:
            if not self._suppressed:
                self._since = now
            self._suppressed += 1

    def flush(self, now: float) -> None:
        """Log the summary of suppressed lines if there are any and a window has passed."""
        if not self._suppressed or now - self._since < self._window:
            return
        self._log.warning(
            "suppressed %d similar %s in the last %.0f s (the counters are in stats())",
            self._suppressed,
            self._what,
            now - self._since,
        )
        self._suppressed = 0
