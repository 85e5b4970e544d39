"""A consumer tier whose producer cannot be reached learns why from the failure itself, on
every load, never by waiting out a deadline.

Nothing listening (refused: a producer process that has exited), a host name that does not
resolve, a CURVE mismatch with a producer in another process, and an HTTP server at the
address: each load fails ``peer_dead``, its detail naming the cause, and loads in a row to a
failing address do not each wait out a handshake (the zmq transport remembers a failed dial
for ``DIAL_BACKOFF``). The consumer's handshake and load deadlines are ``FAR`` (longer than
any wait here), so a load that ended only by a deadline would never end within the test's
wait: ending at all proves the cause was seen. No elapsed time is asserted."""

from __future__ import annotations

import gc
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq_peers
from p2pkv.cli import main as p2pkv_main
from p2pkv.config import TierConfig
from p2pkv.session.session import Session
from p2pkv.testing.child import Child
from p2pkv.testing.waiting import wait_until
from p2pkv.tier import P2PTier
from p2pkv.types import Job, JobResult, Outcome, RequestContext

NUM_BLOCKS, BLOCK_LEN = 16, 256
FAR = 3600.0
"""The consumer's handshake and load deadlines (seconds): never reached here."""
WAIT = 60.0
"""How long a test waits for a load's result (far below ``FAR``)."""


class Consumer:
    def __init__(self, control_options: dict[str, Any] | None = None) -> None:
        self.region = np.zeros(NUM_BLOCKS * BLOCK_LEN, np.uint8)
        config = TierConfig.from_dict(
            {
                "control": "zmq",
                "data": "memory",
                "host": "127.0.0.1",
                "port": 0,
                "control_options": control_options or {},
                "timeouts": {"handshake": FAR, "load": FAR},
            }
        )
        self.tier = P2PTier(config, self.region.data, BLOCK_LEN)
        self.results: dict[int, JobResult] = {}

    def load_from(self, job_id: int, host: str, port: int) -> JobResult:
        """One load of ``kv{job_id}`` from ``host:port``; its result."""
        kv = f"kv{job_id}"
        ctx = RequestContext(
            kv,
            {"remote_prefiller": {"kv_request_id": kv, "remote_host": host, "remote_port": port}},
        )
        self.tier.on_new_request(ctx)
        self.tier.submit_load(Job(job_id, [b"%s/0" % kv.encode()], [0], True, ctx))
        wait_until(
            lambda: job_id in self.results,
            timeout=WAIT,
            what=f"load {job_id}'s result (its deadlines are {FAR}s away)",
            pumps=[self.collect],
        )
        self.tier.on_request_finished(ctx)
        return self.results[job_id]

    def collect(self) -> None:
        for r in self.tier.get_finished_jobs():
            assert r.job_id not in self.results, f"job {r.job_id} reported twice"
            self.results[r.job_id] = r


@pytest.fixture
def consumer() -> Iterator[Consumer]:
    c = Consumer()
    yield c
    c.tier.shutdown()


def stopped_producer_address() -> tuple[str, int]:
    """The address of a producer tier that ran in another process and has exited: its port
    now refuses connections (a prefiller that died, or a wrong ``remote_port``)."""
    with Child(
        zmq_peers.producer_tier, "memory", NUM_BLOCKS, BLOCK_LEN, 1, name="gone-producer"
    ) as child:
        kind, address = child.recv(60, "the producer's address")
        assert kind == "address"
        child.send("stop")
        child.process.join(30)
        assert child.process.exitcode == 0, child.process.exitcode
    host, _, port = address.rpartition(":")
    return host, int(port)


def test_loads_to_a_refused_port_fail_fast_saying_refused(consumer: Consumer) -> None:
    host, port = stopped_producer_address()
    first = consumer.load_from(1, host, port)
    assert first.outcome is Outcome.PEER_DEAD and "refused" in first.detail, first
    later = [consumer.load_from(2 + i, host, port) for i in range(20)]
    assert all(r.outcome is Outcome.PEER_DEAD and "refused" in r.detail for r in later), later


def test_refused_dials_sessions_are_freed_without_the_collector(
    consumer: Consumer, refusing: int
) -> None:
    """Loads naming 20 refusing addresses fail; with the collector off, none of their
    sessions is left alive: reference counting freed them (issue 48)."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for job_id in range(1, 21):
            result = consumer.load_from(job_id, f"127.8.0.{job_id}", refusing)
            assert result.outcome is Outcome.PEER_DEAD, result
        assert not any(isinstance(o, Session) for o in gc.get_objects())
    finally:
        if enabled:
            gc.enable()


def test_a_load_from_an_unresolvable_host_fails_fast_saying_so(consumer: Consumer) -> None:
    result = consumer.load_from(1, "no-such-host.invalid", 5710)
    assert result.outcome is Outcome.PEER_DEAD and "no such host" in result.detail, result


def test_a_curve_mismatch_fails_the_consumers_load_naming_it(tmp_path: Path) -> None:
    for name in ("server", "other", "alice"):
        assert p2pkv_main(["keys", "--dir", str(tmp_path), "--name", name]) == 0
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "alice.key").write_bytes((tmp_path / "alice.key").read_bytes())
    server = {
        "server_secret_key": str(tmp_path / "server.key_secret"),
        "client_secret_key": str(tmp_path / "alice.key_secret"),
        "allowed_client_keys": [str(allowed)],
    }
    with Child(
        zmq_peers.producer_tier, "memory", NUM_BLOCKS, BLOCK_LEN, 1, server, name="curve-producer"
    ) as child:
        kind, address = child.recv(60, "the producer's address")
        assert kind == "address"
        host, _, port = address.rpartition(":")
        # Same allowed client key, but the server key pair it expects is another one.
        consumer = Consumer({**server, "server_secret_key": str(tmp_path / "other.key_secret")})
        try:
            result = consumer.load_from(1, host, int(port))
        finally:
            consumer.tier.shutdown()
        child.send("stop")
    assert result.outcome is Outcome.PEER_DEAD, result
    assert "security handshake failed" in result.detail, result


def test_a_load_from_an_http_server_fails_fast_saying_it_is_no_p2pkv_peer(
    consumer: Consumer,
) -> None:
    """A wrong ``remote_port`` that points at an HTTP server (a proxy's, say)."""
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    stop = threading.Event()

    def answer() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        result = consumer.load_from(1, "127.0.0.1", port)
    finally:
        stop.set()
        thread.join(5)
        server.close()
    assert result.outcome is Outcome.PEER_DEAD, result
    assert "handshake" in result.detail and "within" not in result.detail, result
