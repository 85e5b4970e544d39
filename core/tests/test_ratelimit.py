"""The rate-limited log: a flood cannot flood it, and what it dropped is summarized."""

from __future__ import annotations

import logging

import pytest
from p2pkv.ratelimit import LogLimiter


def test_the_log_limiter_summarizes_what_it_suppressed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="p2pkv.test.ratelimit")
    limiter = LogLimiter(
        logging.getLogger("p2pkv.test.ratelimit"),
        burst=3,
        window=10.0,
        now=0.0,
        what="test warnings",
    )
    for i in range(100):
        limiter.log(i * 0.001, logging.WARNING, "hostile %d", i)
    assert [r.getMessage() for r in caplog.records] == ["hostile 0", "hostile 1", "hostile 2"]
    limiter.flush(5.0)  # within the window: nothing yet
    assert len(caplog.records) == 3
    limiter.flush(10.1)
    assert "suppressed 97 similar test warnings" in caplog.records[-1].getMessage()
    limiter.flush(30.0)  # nothing new was suppressed: no second summary
    assert len(caplog.records) == 4
    limiter.log(30.0, logging.WARNING, "calm again")  # the bucket refilled meanwhile
    assert caplog.records[-1].getMessage() == "calm again"
