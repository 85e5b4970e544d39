"""The zmq context's socket cap (issue 48): derived from the soft descriptor limit when
``control_options`` leaves ``max_sockets`` unset, kept as set otherwise, and what a real
transport's context then holds. The limit is lowered by monkeypatching
``resource.getrlimit``, so no other test of the process sees a changed limit."""

from __future__ import annotations

import resource
from typing import Any

import pytest
import zmq
from p2pkv.errors import ConfigError
from p2pkv.registry import default_registry
from p2pkv_zmq.socket_cap import (
    LIBZMQ_MAX_SOCKETS,
    LIBZMQ_SOCKET_LIMIT,
    SocketCap,
    derived_max_sockets,
    socket_cap,
)


def soft_limit(monkeypatch: pytest.MonkeyPatch, soft: int) -> None:
    """This test's process reports ``soft`` as its soft ``RLIMIT_NOFILE``."""
    real = resource.getrlimit

    def getrlimit(which: int) -> tuple[int, int]:
        return (soft, real(which)[1]) if which == resource.RLIMIT_NOFILE else real(which)

    monkeypatch.setattr(resource, "getrlimit", getrlimit)


@pytest.mark.parametrize(
    "soft, cap",
    [
        (256, 1023),  # a tiny limit: never below libzmq's default
        (1024, 1023),  # the common default: (1024 - 256) // 5 * 3 + 16 = 475, floored
        (4096, 2164),  # (4096 - 512) // 5 = 716 sessions
        (20000, 10516),  # (20000 - 2500) // 5 = 3500 sessions
        (65535, 34420),  # vLLM's set_ulimit: (65535 - 8191) // 5 = 11468 sessions
        (1_048_576, 65535),  # a pod's usual limit: libzmq's ZMQ_SOCKET_LIMIT
        (resource.RLIM_INFINITY, 65535),
    ],
)
def test_the_derived_cap_follows_the_descriptor_limit(soft: int, cap: int) -> None:
    assert derived_max_sockets(soft) == cap


def test_the_derived_cap_keeps_a_reserve_of_descriptors() -> None:
    """Sessions up to the cap never use the descriptors the rest of the process needs."""
    for soft in (2048, 4096, 20000, 65535, 100_000):
        sessions = (derived_max_sockets(soft) - 16) // 3
        assert sessions * 5 <= soft - max(256, soft // 8), soft


def test_a_smaller_socket_limit_of_libzmq_bounds_the_derived_cap() -> None:
    assert derived_max_sockets(1_048_576, socket_limit=4096) == 4096


def test_unset_max_sockets_is_derived_from_this_process_s_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    soft_limit(monkeypatch, 65535)
    assert socket_cap(None) == SocketCap(34420, "derived from ulimit -n 65535")
    soft_limit(monkeypatch, resource.RLIM_INFINITY)
    assert socket_cap(None) == SocketCap(65535, "derived from ulimit -n unlimited")


def test_an_explicit_max_sockets_stays_as_set(monkeypatch: pytest.MonkeyPatch) -> None:
    soft_limit(monkeypatch, 1_048_576)
    assert socket_cap(40) == SocketCap(40, "set by control_options.max_sockets")
    assert socket_cap(LIBZMQ_SOCKET_LIMIT).value == LIBZMQ_SOCKET_LIMIT


@pytest.mark.parametrize("soft, options, cap", [(4096, {}, 2164), (65535, {"max_sockets": 40}, 40)])
def test_a_transport_s_context_holds_the_cap(
    make_transport: Any,
    monkeypatch: pytest.MonkeyPatch,
    soft: int,
    options: dict[str, int],
    cap: int,
) -> None:
    soft_limit(monkeypatch, soft)
    transport = make_transport(**options)
    assert transport._hub._sockets.context.get(zmq.MAX_SOCKETS) == cap


def test_libzmq_s_socket_limit_is_the_ceiling_assumed() -> None:
    """The pure-Python ceiling matches what this libzmq reports (epoll on Linux)."""
    context: zmq.Context[Any] = zmq.Context()
    try:
        assert context.get(zmq.SOCKET_LIMIT) == LIBZMQ_SOCKET_LIMIT
        assert context.get(zmq.MAX_SOCKETS) == LIBZMQ_MAX_SOCKETS
    finally:
        context.term()


def test_check_config_reads_the_cap_off_the_registered_class(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``p2pkv check-config`` never imports this package: it asks the class the registry
    holds for ``control: zmq``, which validates the options as the transport will."""
    soft_limit(monkeypatch, 4096)
    zmq_class = default_registry().transport("control", "zmq")
    assert zmq_class.socket_cap({}) == SocketCap(2164, "derived from ulimit -n 4096")
    assert zmq_class.socket_cap({"max_sockets": 40}).value == 40
    with pytest.raises(ConfigError, match="max_sockets"):
        zmq_class.socket_cap({"max_sockets": 8})
