"""Control-plane benchmark: the ``zmq`` transport against raw pyzmq, two processes, one run.

Each lane echoes frames (200 bytes by default) from a spawned child process:

- ``p2pkv-zmq``: a :class:`ZmqControlTransport` here and one in the child; the child echoes
  every frame on the connection it arrived on (our PUSH out to the child's PULL, the child's
  PUSH back to ours: one TCP stream each way, see :mod:`p2pkv_zmq.hub`).
- ``raw-pyzmq``: a DEALER here, a ROUTER echo in the child: the same library without p2pkv.

Per lane: round trips one at a time (latency p50/p99 in µs), then a stream with ``window``
frames in flight (echoed messages per second). The lanes alternate for ``rounds`` rounds, so
drift on a shared machine hits both alike. Every wait has a deadline. This is a benchmark,
not a test: it reports numbers and asserts nothing about them.

Use :func:`run_control_bench` (returns a dict) or ``python -m p2pkv_zmq.bench [--json]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import zmq
from p2pkv.child import Child
from p2pkv.contracts import ControlConnection, ControlSettings

from p2pkv_zmq.transport import ZmqControlTransport

__all__ = ["run_control_bench"]

LANES = ("raw-pyzmq", "p2pkv-zmq")
_DEADLINE = 30.0  # seconds any single wait may take
_IDLE_WAIT = 0.1  # seconds the echo servers block between checks of the harness pipe


# -- echo servers (child processes) ---------------------------------------------------------


def _echo_p2pkv(pipe: Connection, host: str) -> None:
    t = ZmqControlTransport.create(ControlSettings(host, 0))
    pipe.send(t.local_address)
    peers: list[ControlConnection] = []
    try:
        while True:
            peers.extend(t.poll(_IDLE_WAIT))
            echoed = 0
            for peer in peers:
                for frame in peer.recv():
                    peer.send(frame)
                    echoed += 1
            if not echoed and pipe.poll(0):
                return
    finally:
        t.close()


def _echo_raw(pipe: Connection, host: str) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.rcvtimeo = int(_IDLE_WAIT * 1000)
    router.bind(f"tcp://{host}:*")
    pipe.send(router.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        while True:  # the plainest echo: blocking receive, send back
            try:
                router.send_multipart(router.recv_multipart())
            except zmq.Again:
                if pipe.poll(0):
                    return
    finally:
        router.close(0)
        ctx.term()


# -- clients (this process) -----------------------------------------------------------------


class _Client:
    """One lane's sending side: ``send`` a frame, ``receive`` echoes (waiting for the first;
    returns how many arrived)."""

    def __init__(self, lane: str, host: str) -> None:
        self.lane = lane
        server = _echo_p2pkv if lane == "p2pkv-zmq" else _echo_raw
        self.child = Child(server, host, name=f"p2pkv-zmq-bench-{lane}").start()
        address = self.child.recv(_DEADLINE, "the echo server's address")
        self.send: Callable[[bytes], None]
        self.receive: Callable[[float], int]
        if lane == "p2pkv-zmq":
            self._transport = ZmqControlTransport.create(ControlSettings(host, 0))
            conn = self._transport.connect(address)

            def receive_p2pkv(timeout: float) -> int:
                got = len(conn.recv())
                if not got:
                    self._transport.poll(timeout)
                    got = len(conn.recv())
                return got

            self.send, self.receive = conn.send, receive_p2pkv
        else:
            self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
            dealer = self._dealer = self._ctx.socket(zmq.DEALER)
            dealer.linger = 0
            dealer.rcvtimeo = int(_DEADLINE * 1000)
            dealer.connect(address)

            def receive_raw(timeout: float) -> int:
                dealer.recv()  # the plainest client: a blocking receive (zmq.Again on timeout)
                return 1

            self.send, self.receive = dealer.send, receive_raw

    def close(self) -> None:
        if self.lane == "p2pkv-zmq":
            self._transport.close()
        else:
            self._dealer.close(0)
            self._ctx.term()
        self.child.send("stop")
        self.child.stop()


def _round_trips(client: _Client, frame: bytes, count: int) -> list[int]:
    out = []
    for _ in range(count):
        t0 = time.perf_counter_ns()
        client.send(frame)
        limit = time.monotonic() + _DEADLINE
        while not client.receive(_DEADLINE):
            if time.monotonic() > limit:
                raise TimeoutError(f"{client.lane}: no echo within {_DEADLINE} s")
        out.append(time.perf_counter_ns() - t0)
    return out


def _stream(client: _Client, frame: bytes, count: int, window: int) -> float:
    """Seconds to get ``count`` echoes with at most ``window`` frames in flight."""
    sent = got = 0
    t0 = time.perf_counter()
    limit = time.monotonic() + _DEADLINE
    while got < count:
        while sent < count and sent - got < window:
            client.send(frame)
            sent += 1
        got += client.receive(_DEADLINE)
        if time.monotonic() > limit:
            raise TimeoutError(f"{client.lane}: stream stalled at {got}/{count}")
    return time.perf_counter() - t0


def run_control_bench(
    *,
    count: int = 2000,
    frame_bytes: int = 200,
    window: int = 64,
    rounds: int = 3,
    warmup: int = 200,
    host: str = "127.0.0.1",
) -> dict[str, Any]:
    """Measure both lanes; returns ``{"lanes": {lane: {p50_us, p99_us, msgs_per_s}},
    "ratio": {p50, p99, msgs_per_s}, ...}`` where ratios are p2pkv-zmq / raw-pyzmq."""
    frame = bytes(range(256)) * (frame_bytes // 256) + bytes(frame_bytes % 256)
    rtts: dict[str, list[int]] = {lane: [] for lane in LANES}
    streamed: dict[str, float] = dict.fromkeys(LANES, 0.0)
    clients = {lane: _Client(lane, host) for lane in LANES}
    try:
        for client in clients.values():
            _round_trips(client, frame, warmup)
        for _ in range(rounds):
            for lane, client in clients.items():
                rtts[lane].extend(_round_trips(client, frame, count))
                streamed[lane] += _stream(client, frame, count, window)
    finally:
        for client in clients.values():
            client.close()
    lanes = {
        lane: {**_percentiles(rtts[lane]), "msgs_per_s": count * rounds / streamed[lane]}
        for lane in LANES
    }
    ours, raw = lanes["p2pkv-zmq"], lanes["raw-pyzmq"]
    return {
        "frame_bytes": frame_bytes,
        "round_trips": count * rounds,
        "window": window,
        "lanes": lanes,
        "ratio": {key: ours[key] / raw[key] for key in ("p50_us", "p99_us", "msgs_per_s")},
    }


def _percentiles(samples_ns: Sequence[int]) -> dict[str, float]:
    us = np.asarray(samples_ns, dtype=np.float64) / 1000.0
    return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99))}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m p2pkv_zmq.bench", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--count", type=int, default=2000, help="round trips per lane per round")
    p.add_argument("--frame-bytes", type=int, default=200)
    p.add_argument("--window", type=int, default=64, help="frames in flight when streaming")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    result = run_control_bench(
        count=args.count,
        frame_bytes=args.frame_bytes,
        window=args.window,
        rounds=args.rounds,
        host=args.host,
    )
    if args.json:
        json.dump(result, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
        return 0
    print(
        f"{result['frame_bytes']}-byte frames, {result['round_trips']} round trips per lane, "
        f"two processes on {args.host}"
    )
    print(f"{'lane':<12}{'p50 µs':>10}{'p99 µs':>10}{'msgs/s':>12}")
    for lane, r in result["lanes"].items():
        print(f"{lane:<12}{r['p50_us']:>10.1f}{r['p99_us']:>10.1f}{r['msgs_per_s']:>12.0f}")
    ratio = result["ratio"]
    print(
        f"{'ratio':<12}{ratio['p50_us']:>9.2f}x{ratio['p99_us']:>9.2f}x"
        f"{ratio['msgs_per_s']:>11.2f}x  (p2pkv-zmq / raw-pyzmq)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
