"""A dial with no socket left says which limit it hit, in one wording (issue 48, item 3).

:func:`p2pkv_zmq.sockets.no_socket_left` writes the error of a zmq dial and of a reach
check alike. Out of descriptors, it names ``ulimit -n`` with the limit and the count open;
out of the zmq context's sockets, ``ZMQ_MAX_SOCKETS`` with its value. A real reach check
fails so once the process's descriptor limit leaves no descriptor free.
"""

from __future__ import annotations

import errno
import os
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import cast

import pytest
from p2pkv.errors import ResourceUnavailable
from p2pkv_zmq.connection import ZmqConnection
from p2pkv_zmq.poller import Readiness
from p2pkv_zmq.reach import ReachChecks
from p2pkv_zmq.sockets import no_socket_left

KEY = "10.0.0.7:5710"


def _unused(*_: object) -> None:
    raise AssertionError("no check may end here")


@contextmanager
def no_descriptor_left() -> Iterator[int]:
    """The soft descriptor limit lowered to the lowest free descriptor (restored after): no
    new descriptor fits. Yields the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest = os.dup(0)
    os.close(lowest)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))
    try:
        yield lowest
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_out_of_descriptors_names_the_limit_and_the_open_count() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    error = no_socket_left(KEY, OSError(errno.EMFILE, "Too many open files"))
    text = str(error)
    assert isinstance(error, ResourceUnavailable)
    assert text.startswith(f"cannot dial zmq peer {KEY}: no socket left (")
    assert f"ulimit -n = {soft}, " in text and " open): raise it" in text, text


def test_out_of_zmq_sockets_names_the_contexts_cap() -> None:
    text = str(no_socket_left(KEY, OSError(errno.EMFILE, "Too many open files"), 1023))
    assert "ZMQ_MAX_SOCKETS = 1023" in text and "peers.max_dialed" in text, text


def test_a_reach_check_without_a_descriptor_says_so_in_the_same_words() -> None:
    readiness = Readiness()
    checks = ReachChecks(readiness, _unused, _unused)
    conn = cast(ZmqConnection, SimpleNamespace(key=KEY))
    with pytest.raises(ResourceUnavailable) as raised, no_descriptor_left() as limit:
        checks.start(conn, "127.0.0.1", 9, "tcp://127.0.0.1:9")
    text = str(raised.value)
    assert text.startswith(f"cannot dial zmq peer {KEY}: no socket left (")
    assert f"ulimit -n = {limit}, " in text, text
    assert len(checks) == 0 and checks.started == 0
