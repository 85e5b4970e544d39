"""What a hub's sweep costs with N quiet connections: ``python -m p2pkv_zmq.sweep_bench 10 1000``.

One transport dials N addresses of a raw pyzmq PULL bound on N loopback ports; every dial
completes its ZMTP handshake, then nothing is sent (heartbeats are libzmq's). Then it polls
with a sweep each time, 11 ms apart. Per N, a JSON line: sweeps, sockets and timer entries
examined per sweep (``Readiness.work``), Python calls per sweep (``sys.setprofile``), and the
process CPU per poll (both ends' heartbeats included: the PULL is in this process). A
benchmark, not a test: ``transports/zmq/tests/test_fleet_scale.py`` holds the property.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

import zmq
from p2pkv.contracts import ControlSettings

from p2pkv_zmq.transport import ZmqControlTransport

__all__ = ["measure_sweeps"]

_POLLS = 200
_PACE = 0.011  # seconds between polls: each one sweeps
_DEADLINE = 120.0


def measure_sweeps(connections: int) -> dict[str, Any]:
    """The figures of one N (see the module docstring)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    t = ZmqControlTransport.create(
        ControlSettings("127.0.0.1", 0, options={"max_sockets": 8 * connections + 64})
    )
    try:
        conns: list[Any] = [
            t.connect(f"127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}")
            for _ in range(connections)
        ]
        limit = time.monotonic() + _DEADLINE
        while not all(c.progress == "ready" for c in conns):
            if time.monotonic() > limit:
                raise TimeoutError(f"{connections} handshakes took over {_DEADLINE} s")
            t.poll(0.01)
        return _measure(t, connections)
    finally:
        t.close()
        ctx.destroy(0)


def _measure(t: ZmqControlTransport, connections: int) -> dict[str, Any]:
    poller: Any = t._hub.poller
    calls = 0

    def count(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    t.poll(0.0)
    sweeps, work, cpu = poller.sweeps, poller.readiness.work, time.process_time()
    for _ in range(_POLLS):
        time.sleep(_PACE)
        t.poll(0.0)
    cpu_us = (time.process_time() - cpu) / _POLLS * 1e6
    profiled = poller.sweeps
    sys.setprofile(count)
    try:
        for _ in range(_POLLS // 4):
            time.sleep(_PACE)
            t.poll(0.0)
    finally:
        sys.setprofile(None)
    done = poller.sweeps - sweeps
    return {
        "connections": connections,
        "sweeps": done,
        "examined_per_sweep": round((poller.readiness.work - work) / done, 2),
        "python_calls_per_sweep": round(calls / (poller.sweeps - profiled), 1),
        "cpu_us_per_poll": round(cpu_us, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    sizes = [int(a) for a in (sys.argv[1:] if argv is None else argv)] or [10, 1000]
    for n in sizes:
        sys.stdout.write(json.dumps(measure_sweeps(n)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
