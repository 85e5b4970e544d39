"""One regression test per defect of the upstream P2P tier (reference §7, items 1-18).

Each test is named after the defect and fails on the behaviour the reference describes.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Sequence
from functools import partial
from typing import Any, ClassVar, NoReturn

import msgpack
import pytest
from p2pkv.contracts import (
    DataSettings,
    DataTransport,
    PollResult,
)
from p2pkv.errors import ProtocolError, TransportUnavailable
from p2pkv.protocol import (
    Bye,
    Fetch,
    Hello,
)
from p2pkv.reference.control import MemoryControlTransport
from p2pkv.reference.data import MemoryDataTransport
from p2pkv.reference.delegating import DelegatingDataTransport
from p2pkv.reference.faults import Fault, FaultInjector
from p2pkv.registry import Registry
from p2pkv.testing import harness as h
from p2pkv.tier import P2PTier
from p2pkv.types import Job, LookupResult, Outcome, RequestContext


class Recording(DelegatingDataTransport):
    """Delegates to a memory data transport and records what the tier asked when."""

    name: ClassVar[str] = "recording"

    def __init__(self, inner: DataTransport) -> None:
        super().__init__(inner)
        self.in_flight: set[int] = set()
        self.log: list[tuple[str, int]] = []  # (call, transfers in flight at that moment)
        self.polls = 0

    def remove_peer(self, peer_id: str) -> list[int]:
        self.log.append(("remove_peer", len(self.in_flight)))
        return super().remove_peer(peer_id)

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        tid = super().read_blocks(peer_id, local_idxs, remote_idxs)
        self.in_flight.add(tid)
        return tid

    def poll(self, peer_id: str | None = None) -> PollResult:
        self.polls += 1
        res = super().poll(peer_id)
        self.in_flight.difference_update(res.done)
        self.in_flight.difference_update(res.failed)
        return res

    def cancel(self, transfer_ids: Sequence[int]) -> None:
        super().cancel(transfer_ids)
        self.in_flight.difference_update(transfer_ids)

    def close(self) -> list[int]:
        self.log.append(("close", len(self.in_flight)))
        return super().close()


def recording_node(cluster: h.Cluster, **data_options: Any) -> tuple[Any, Recording]:
    node = cluster(data_options=data_options)
    rec = Recording(node.data)
    node.data = rec
    node.tier._data = rec  # type: ignore[assignment]  # records, then delegates to the guard
    node.tier._env.data = rec
    return node, rec


# 1 ----------------------------------------------------------------------------------------------


def test_defect_01_missing_transport_library_fails_fast_at_construction() -> None:
    class Missing(MemoryDataTransport):
        name: ClassVar[str] = "missing"

        @classmethod
        def create(cls, settings: DataSettings) -> NoReturn:
            raise TransportUnavailable("missing", "p2pkv-missing", "libfoo not importable")

    class Plugin:
        P2PKV_PLUGIN_API = 1

        @staticmethod
        def p2pkv_transports() -> list[type]:
            return [Missing, MemoryControlTransport]

    from p2pkv.hookspecs import hookimpl

    Plugin.p2pkv_transports = hookimpl(Plugin.p2pkv_transports)  # type: ignore[method-assign]
    reg = Registry.from_plugins([("missing", Plugin)])
    with pytest.raises(TransportUnavailable, match="pip install p2pkv-missing"):
        P2PTier(h.config(data="missing"), memoryview(bytearray(64)), 16, registry=reg)


# 2 ----------------------------------------------------------------------------------------------


def test_defect_02_a_refused_read_fails_both_sides_at_once(cluster: h.Cluster) -> None:
    faults = FaultInjector(seed=2)
    p, c = cluster(faults=faults), cluster(faults=faults)
    try:
        pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
        c.load(1, h.keys("r", 2), [0, 1], cctx)
        h.pump([p, c], 3)
        faults.arm(Fault.FAIL_SUBMIT, count=1)
        p.store(2, h.keys("r", 2), [5, 6], pctx)
        h.pump([p, c], 4)  # no cluster.clock advance: no timeout involved
        assert c.outcome(1) is Outcome.SUBMIT_FAILED and p.outcome(2) is Outcome.ABORTED
    finally:
        p.shutdown()
        c.shutdown()


# 3 ----------------------------------------------------------------------------------------------


def test_defect_03_store_timeout_then_finalize_reports_once(cluster: h.Cluster) -> None:
    p, c = cluster(timeouts={"store": 20}), cluster()
    pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
    p.tier.on_new_request(pctx)
    p.store(1, h.keys("r", 2), [0, 1], pctx)
    c.load(2, h.keys("r", 1, 5), [3], cctx)  # binds the request, demands something else
    h.pump([p, c], 3)
    h.advance(cluster.clock, [p, c], 20.5)
    assert p.outcome(1) is Outcome.STORE_TIMEOUT
    p.tier.on_request_finished(pctx)  # finalize: must not report job 1 again
    h.pump([p, c], 3)  # Node.collect fails on any duplicate
    assert c.outcome(2) is Outcome.DEMAND_UNMET
    c.tier.on_request_finished(cctx)
    h.pump([p, c], 3)
    h.assert_clean(p, c)


# 4 ----------------------------------------------------------------------------------------------


def test_defect_04_messages_before_the_handshake_close_that_session_only(
    cluster: h.Cluster,
) -> None:
    p, good = cluster(), cluster()
    with h.RawPeer(p) as rogue:
        msgs = rogue.send(Fetch("r", 0, [b"a"]))  # before any hello
        assert isinstance(msgs[0], Hello)
        assert isinstance(msgs[-1], Bye) and "before the handshake" in msgs[-1].reason
        assert p.tier.stats()["protocol_errors"] == 1
    # the other peer is unaffected
    pctx, cctx = p.producer_ctx("ok"), good.consumer_ctx("ok", p)
    p.store(1, [b"k"], [0], pctx)
    good.load(2, [b"k"], [0], cctx)
    h.pump_until([p, good], lambda: 2 in good.results)
    assert good.outcome(2) is Outcome.DONE


def test_defect_04_a_second_hello_does_not_re_register_the_peer(cluster: h.Cluster) -> None:
    with h.RawPeer(cluster()) as peer:
        peer.send(peer.hello())
        msgs = peer.send(peer.hello())  # same incarnation again
        assert isinstance(msgs[-1], Bye) and "duplicate hello" in msgs[-1].reason


# 5 ----------------------------------------------------------------------------------------------


def test_defect_05_the_tier_runs_no_threads_of_its_own(cluster: h.Cluster) -> None:
    before = set(threading.enumerate())
    p, c = cluster(), cluster()
    pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
    p.store(1, [b"a"], [0], pctx)
    c.load(2, [b"a"], [0], cctx)
    h.pump_until([p, c], lambda: 2 in c.results)
    assert set(threading.enumerate()) == before


# 6 ----------------------------------------------------------------------------------------------


def test_defect_06_shutdown_never_closes_the_data_plane_under_a_live_read(
    cluster: h.Cluster,
) -> None:
    c, rec = recording_node(cluster, completion_polls=4)
    p = cluster()
    try:
        pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
        c.load(1, [b"a"], [0], cctx)
        h.pump([p, c], 3)
        p.store(2, [b"a"], [5], pctx)
        p.tier.tick()
        c.tier.tick()
        assert rec.in_flight
        c.shutdown()
        assert ("close", 0) in rec.log and all(n == 0 for _, n in rec.log)
        assert c.outcome(1) is Outcome.SHUTDOWN
    finally:
        p.shutdown()


def test_defect_06_a_dead_peer_is_removed_only_after_its_reads_ended(cluster: h.Cluster) -> None:
    faults = FaultInjector(seed=6)
    c = cluster(faults=faults, data_options={"completion_polls": 3})
    rec = Recording(c.data.inner)
    c.data.inner = rec
    p = cluster(faults=faults)
    try:
        pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
        c.load(1, [b"a"], [0], cctx)
        h.pump([p, c], 3)
        p.store(2, [b"a"], [5], pctx)
        p.tier.tick()
        c.tier.tick()
        assert rec.in_flight
        faults.partition(p.address, c.address)
        h.pump_until([c], lambda: 1 in c.results)
        assert ("remove_peer", 0) in rec.log and all(n == 0 for _, n in rec.log)
        assert c.outcome(1) is Outcome.PEER_DEAD
    finally:
        p.shutdown()
        c.shutdown()


# 7 ----------------------------------------------------------------------------------------------


def test_defect_07_ports_are_bound_not_probed_and_time_is_injected(cluster: h.Cluster) -> None:
    a, b = cluster(), cluster()
    assert a.address != b.address and a.port and b.port  # port 0 -> read back what was bound
    cctx = b.consumer_ctx("r", a)
    b.load(1, [b"a"], [0], cctx)
    h.pump([a, b], 3)
    cluster.clock.advance(10_000)  # a timeout path with no sleeping at all
    h.pump([a, b], 4)
    assert b.outcome(1) is Outcome.LOAD_TIMEOUT


# 8 ----------------------------------------------------------------------------------------------


def test_defect_08_a_hello_from_another_identity_is_rejected(cluster: h.Cluster) -> None:
    with h.RawPeer(cluster()) as peer:
        msgs = peer.send(peer.hello(address="0.0.0.0:5710"))
        assert isinstance(msgs[-1], Bye) and "not the connection's peer address" in msgs[-1].reason


def test_defect_08_one_peer_is_one_session_in_both_directions(cluster: h.Cluster) -> None:
    a, b = cluster(), cluster()
    for src, dst, kv in ((a, b, "ab"), (b, a, "ba")):
        src.store(1 if kv == "ab" else 3, [kv.encode()], [0], src.producer_ctx(kv))
        dst.load(2 if kv == "ab" else 4, [kv.encode()], [1], dst.consumer_ctx(kv, src))
    h.pump_until([a, b], lambda: len(a.results) == 2 and len(b.results) == 2)
    assert a.tier.stats()["sessions"] == 1 and b.tier.stats()["sessions"] == 1


# 9 ----------------------------------------------------------------------------------------------


def test_defect_09_a_load_of_a_finished_request_is_reported_not_dropped(cluster: h.Cluster) -> None:
    p, c = cluster(), cluster()
    cctx = c.consumer_ctx("r", p)
    c.tier.on_new_request(cctx)
    c.load(1, [b"a"], [0], cctx)
    h.pump([p, c], 3)
    c.tier.on_request_finished(cctx)
    h.pump_until([p, c], lambda: 1 in c.results)
    assert c.outcome(1) is Outcome.REQUEST_FINISHED


# 10 ---------------------------------------------------------------------------------------------


def test_defect_10_several_loads_per_request_each_complete(cluster: h.Cluster) -> None:
    p, c = cluster(), cluster()
    pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
    ks = h.keys("r", 4)
    p.store(1, ks, [0, 1, 2, 3], pctx)
    c.load(2, ks[:2], [10, 11], cctx)
    h.pump_until([p, c], lambda: 2 in c.results)
    c.load(3, ks[2:], [12, 13], cctx)  # a second fetch for the same id: no disconnect
    h.pump_until([p, c], lambda: 3 in c.results and 1 in p.results)
    assert c.outcome(2) is Outcome.DONE and c.outcome(3) is Outcome.DONE
    assert p.outcome(1) is Outcome.DONE and c.tier.stats()["sessions"] == 1
    assert (c.blocks[10:14] == p.blocks[0:4]).all()


# 11 ---------------------------------------------------------------------------------------------


def test_defect_11_terminal_empty_fetch_leaves_no_zombie(cluster: h.Cluster) -> None:
    p, c = cluster(), cluster()
    for _ in range(2):  # the same id twice: the second must not be a "duplicate fetch"
        cctx = c.consumer_ctx("s", p, probe=True)
        c.tier.on_new_request(cctx)
        h.pump([p, c], 3)
        assert h.probe_until(c, b"a", cctx, [p]) is LookupResult.MISS
        c.tier.on_request_finished(cctx)
        h.pump([p, c], 3)
        h.assert_clean(p, c)
    pctx, cctx = p.producer_ctx("s"), c.consumer_ctx("s", p)
    p.store(1, [b"a"], [0], pctx)
    c.load(2, [b"a"], [0], cctx)
    h.pump_until([p, c], lambda: 2 in c.results)
    assert c.outcome(2) is Outcome.DONE and p.tier.stats()["protocol_errors"] == 0


# 12 ---------------------------------------------------------------------------------------------


def test_defect_12_late_fetch_for_a_reaped_request_is_refused_at_once(cluster: h.Cluster) -> None:
    p, c = cluster(), cluster()
    pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
    p.tier.on_new_request(pctx)
    p.store(1, [b"a"], [0], pctx)
    p.tier.on_request_finished(pctx)
    h.advance(cluster.clock, [p, c], 60.5)
    assert p.outcome(1) is Outcome.UNBOUND_TIMEOUT
    c.load(2, [b"a"], [0], cctx)
    h.pump_until([p, c], lambda: 2 in c.results, rounds=8)  # no cluster.clock advance needed
    assert c.outcome(2) is Outcome.DEMAND_UNMET


# 13 ---------------------------------------------------------------------------------------------


def test_defect_13_producer_requests_store_every_block_including_prefix_hits(
    cluster: h.Cluster,
) -> None:
    p, c = cluster(), cluster()
    assert p.tier.on_new_request(p.producer_ctx("r")) is True
    assert p.tier.on_new_request(c.consumer_ctx("q", p)) is False
    assert p.tier.on_new_request(RequestContext("plain")) is False
    both = RequestContext(
        "b",
        {
            "remote_decoder": {"kv_request_id": "x"},
            "remote_kv_source": {
                "kv_request_id": "y",
                "remote_host": c.host,
                "remote_port": c.port,
            },
        },
    )
    assert p.tier.on_new_request(both) is True


# 14 ---------------------------------------------------------------------------------------------


def test_defect_14_duplicate_keys_in_a_fetch_are_refused(cluster: h.Cluster) -> None:
    p, c = cluster(), cluster()
    with pytest.raises(ValueError, match="duplicate keys"):
        c.tier.submit_load(Job(1, [b"a", b"a"], [0, 1], True, c.consumer_ctx("r", p)))
    with h.RawPeer(p) as peer:
        (hello, _) = peer.send(peer.hello())
        assert isinstance(hello, Hello)
        msgs = peer.send(
            msgpack.packb({"type": "hello_ack", "epoch": hello.epoch}), Fetch("r", 0, [b"a", b"a"])
        )
        assert isinstance(msgs[-1], Bye) and "duplicate key" in msgs[-1].reason


def test_defect_14_a_failing_completion_check_fails_the_transfer_promptly(
    cluster: h.Cluster,
) -> None:
    faults = FaultInjector(seed=14)
    p, c = cluster(faults=faults), cluster(faults=faults)
    try:
        faults.arm(Fault.FAIL_COMPLETION, count=1)
        p.store(1, [b"a"], [0], p.producer_ctx("r"))
        c.load(2, [b"a"], [0], c.consumer_ctx("r", p))
        h.pump_until([p, c], lambda: 2 in c.results and 1 in p.results, rounds=10)
        assert c.outcome(2) is Outcome.TRANSFER_FAILED
    finally:
        p.shutdown()
        c.shutdown()


# 15 ---------------------------------------------------------------------------------------------


def test_defect_15_a_dead_connection_is_closed_and_the_peer_redialled(cluster: h.Cluster) -> None:
    faults = FaultInjector(seed=15)
    p, c = cluster(faults=faults), cluster(faults=faults)
    try:
        p.store(1, [b"a"], [0], p.producer_ctx("r"))
        c.load(2, [b"a"], [0], c.consumer_ctx("r", p))
        h.pump_until([p, c], lambda: 2 in c.results)
        conn = c.tier.peer_connection(p.address)
        assert conn is not None
        faults.kill(conn)
        h.pump([p, c], 3)
        assert not conn.alive and c.tier.stats()["sessions"] == 0
        p.store(3, [b"b"], [1], p.producer_ctx("s"))
        c.load(4, [b"b"], [1], c.consumer_ctx("s", p))
        h.pump_until([p, c], lambda: 4 in c.results)
        assert c.outcome(4) is Outcome.DONE
    finally:
        p.shutdown()
        c.shutdown()


# 16 ---------------------------------------------------------------------------------------------


def test_defect_16_finishing_a_symmetric_consumer_cancels_its_probes(cluster: h.Cluster) -> None:
    p, c = cluster(), cluster()
    cctx = c.consumer_ctx("s", p, probe=True)
    c.tier.on_new_request(cctx)
    h.pump([p, c], 3)
    assert c.tier.lookup(b"a", cctx) is LookupResult.RETRY
    c.tier.on_schedule_end()
    c.tier.on_request_finished(cctx)  # probe in flight
    h.pump([p, c], 3)
    h.assert_clean(p, c)


# 17 ---------------------------------------------------------------------------------------------


def test_defect_17_prefiller_first_requests_leave_no_binding(cluster: h.Cluster) -> None:
    p, c = cluster(), cluster()
    for i in range(40):
        kv = f"r{i}"
        pctx, cctx = p.producer_ctx(kv), c.consumer_ctx(kv, p)
        p.tier.on_new_request(pctx)
        c.tier.on_new_request(cctx)
        p.store(2 * i, [kv.encode()], [i % 8], pctx)
        p.tier.on_request_finished(pctx)  # the prefill is over before the decode fetches
        c.load(2 * i + 1, [kv.encode()], [i % 8], cctx)
        h.pump_until([p, c], partial(operator.contains, c.results, 2 * i + 1))
        c.tier.on_request_finished(cctx)
    h.pump([p, c], 3)
    assert p.tier.state_sizes()["bindings"] == 0
    assert all(r.outcome is Outcome.DONE for r in c.results.values())


# 18 ---------------------------------------------------------------------------------------------


def test_defect_18_an_idle_tier_asks_for_no_ticks_and_polls_nothing(cluster: h.Cluster) -> None:
    c, rec = recording_node(cluster)
    p = cluster()
    try:
        p.store(1, [b"a"], [0], p.producer_ctx("r"))
        c.load(2, [b"a"], [0], c.consumer_ctx("r", p))
        h.pump_until([p, c], lambda: 1 in p.results and 2 in c.results)
        assert not p.tier.has_pending_work() and not c.tier.has_pending_work()
        polls = rec.polls
        for _ in range(20):
            c.tier.tick()
        assert rec.polls == polls  # only progress(), no per-peer polling while idle
    finally:
        p.shutdown()
        c.shutdown()


def test_protocol_error_type_is_a_value_error() -> None:
    assert issubclass(ProtocolError, ValueError)
