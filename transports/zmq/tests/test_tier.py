"""P2PTier pairs over ``zmq`` control and ``memory`` data in one process (real sockets, real
clock), built from tier configs through the registry like an engine adapter would."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import zmq_peers
from p2pkv.addressing import parse_address
from p2pkv.config import TierConfig
from p2pkv.errors import ConfigError
from p2pkv.registry import default_registry
from p2pkv.testing.child import Child
from p2pkv.testing.waiting import wait_until
from p2pkv.tier import P2PTier
from p2pkv.types import Job, JobResult, LookupResult, Outcome, RequestContext
from p2pkv_zmq import ZmqControlTransport
from zmq_tiers import BLOCK_LEN, NUM_BLOCKS, REGISTRY, Peer, T, contexts, run_request, tick


def test_the_tier_builds_the_zmq_transport_from_its_config(pair: tuple[Peer, Peer]) -> None:
    producer, _ = pair
    assert isinstance(producer.tier._control, ZmqControlTransport)


@pytest.mark.parametrize("order", ["producer_first", "consumer_first"])
def test_pd_requests_over_zmq_control_move_bytes_exactly(
    pair: tuple[Peer, Peer],
    order: str,
) -> None:
    producer, consumer = pair
    for round_ in range(3):  # several requests over the same session
        slots = list(range(16 * round_, 16 * round_ + 16))
        run_request(producer, consumer, f"{order}-{round_}", slots, order == "consumer_first")
    assert producer.tier._control.stats()["connections"] == 1  # type: ignore[attr-defined]


def test_producer_gone_fails_the_load_with_peer_dead(pair: tuple[Peer, Peer]) -> None:
    producer, consumer = pair
    pctx, cctx = contexts("doomed", producer)
    producer.tier.on_new_request(pctx)
    consumer.tier.on_new_request(cctx)
    consumer.job(1, [b"doomed/0", b"doomed/1"], [0, 1], load=True, ctx=cctx)
    wait_until(
        lambda: consumer.tier.stats().get("sessions", 0) >= 1,
        timeout=T,
        what="the session",
        pumps=[tick(producer, consumer)],
    )
    producer.tier._control.close()  # the producer's control plane vanishes (no goodbye)
    wait_until(
        lambda: 1 in consumer.results, timeout=T, what="the load to fail", pumps=[tick(consumer)]
    )
    assert consumer.results[1].outcome is Outcome.PEER_DEAD


def test_a_tier_on_a_taken_port_names_the_rank_offset(pair: tuple[Peer, Peer]) -> None:
    producer, _ = pair
    config = TierConfig.from_dict(
        {"control": "zmq", "data": "memory", "host": "127.0.0.1", "port": producer.port - 1},
        dp_rank=1,
    )
    region = bytearray(NUM_BLOCKS * BLOCK_LEN)
    with pytest.raises(ConfigError) as err:
        P2PTier(config, memoryview(region), BLOCK_LEN, registry=REGISTRY)
    text = str(err.value)
    assert f"port {producer.port} " in text and "rank offset 1" in text
    assert text.endswith("choose another base port with the tier config key 'port'")


def test_a_taken_port_set_by_vllms_variable_names_that_variable(pair: tuple[Peer, Peer]) -> None:
    """Under vLLM, VLLM_P2P_SIDE_CHANNEL_PORT overrides P2PKV_PORT: the hint names the one in
    force, not one whose change would do nothing."""
    producer, _ = pair
    env = {"VLLM_P2P_SIDE_CHANNEL_PORT": str(producer.port), "P2PKV_PORT": "7000"}
    config = TierConfig.from_dict(
        {"control": "zmq", "data": "memory", "host": "127.0.0.1"},
        environ=env,
        port_env=("VLLM_P2P_SIDE_CHANNEL_PORT", "P2PKV_PORT"),
    )
    region = bytearray(NUM_BLOCKS * BLOCK_LEN)
    with pytest.raises(ConfigError) as err:
        P2PTier(config, memoryview(region), BLOCK_LEN, registry=REGISTRY)
    text = str(err.value)
    assert "environment variable VLLM_P2P_SIDE_CHANNEL_PORT (it set this port" in text
    assert "P2PKV_PORT" not in text


def test_pd_request_across_processes_over_zmq_control(tmp_path: Any) -> None:
    """Producer tier in a child process, consumer here: zmq control, a cross-process data
    transport (nixl, else ucx), bytes checked."""
    registry = default_registry()
    data = next(
        (
            name
            for name in ("nixl", "ucx")
            if name in registry.entries("data")
            and registry.entries("data")[name].cls.availability() is None
        ),
        None,
    )
    if data is None:
        pytest.skip("no cross-process data transport installed (p2pkv-nixl or p2pkv-ucx)")
    seed = 7
    with Child(
        zmq_peers.producer_tier, data, NUM_BLOCKS, BLOCK_LEN, seed, name="producer-tier"
    ) as child:
        kind, address = child.recv(60, "the producer's address")
        assert kind == "address"
        host, port = parse_address(address)
        region = bytearray(NUM_BLOCKS * BLOCK_LEN)
        config = TierConfig.from_dict(
            {"control": "zmq", "data": data, "host": "127.0.0.1", "port": 0}
        )
        consumer = P2PTier(config, memoryview(region), BLOCK_LEN)
        try:
            keys = [b"x/%d" % i for i in range(8)]
            src, dst = list(range(8)), list(range(20, 28))
            ctx = RequestContext(
                "c",
                {
                    "remote_prefiller": {
                        "kv_request_id": "x",
                        "remote_host": host,
                        "remote_port": port,
                    }
                },
            )
            consumer.on_new_request(ctx)
            consumer.submit_load(Job(1, keys, dst, True, ctx))
            child.send(("store", 2, "x", keys, src))
            results: list[JobResult] = []
            wait_until(
                lambda: results.extend(consumer.get_finished_jobs()) or results,
                timeout=30,
                what="the load's result",
                pumps=[lambda: consumer.tick(0.01)],
            )
            assert results[0].outcome is Outcome.DONE, results
            assert child.recv(30, "the store's result") == ("result", 2, "done")
            produced = (
                np.random.default_rng(seed)
                .integers(0, 256, NUM_BLOCKS * BLOCK_LEN, np.uint8)
                .reshape(NUM_BLOCKS, BLOCK_LEN)
            )
            got = np.frombuffer(region, np.uint8).reshape(NUM_BLOCKS, BLOCK_LEN)
            assert (got[dst] == produced[src]).all()
            consumer.on_request_finished(ctx)
            child.send(("finish", "x"))
        finally:
            consumer.shutdown()
            child.send("stop")


def test_a_frame_leaves_when_the_call_that_queued_it_returns(pair: tuple[Peer, Peer]) -> None:
    """The tier batches its zmq sends (``batch_sends``) and flushes as each public call
    returns: after the consumer's one ``submit_load``, the producer alone (the consumer never
    called again) sees the fetch that asks for its parked store."""
    producer, consumer = pair
    assert consumer.tier._control._hub.batching  # type: ignore[attr-defined]
    run_request(producer, consumer, "warm", [0], consumer_first=False)  # the session
    pctx, cctx = contexts("lone", producer)
    producer.tier.on_new_request(pctx)
    consumer.tier.on_new_request(cctx)
    producer.job(1, [b"lone/0"], [1], load=False, ctx=pctx)
    assert producer.tier.stats()["parked_stores"] == 1
    consumer.job(2, [b"lone/0"], [2], load=True, ctx=cctx)
    wait_until(
        lambda: producer.tier.stats()["parked_stores"] == 0,
        timeout=T,
        what="the fetch at the producer",
        pumps=[tick(producer)],
    )
    wait_until(
        lambda: 2 in consumer.results, timeout=T, what="the load", pumps=[tick(producer, consumer)]
    )
    assert consumer.results[2].outcome is Outcome.DONE


def test_a_call_that_queued_no_frame_makes_no_flush(pair: tuple[Peer, Peer]) -> None:
    """The guard flushes only after a call that queued a frame: a request's routing and its
    lookups send nothing and flush nothing (nor does a flood name that waits for a dial).
    The load that sends a fetch still flushes as its call returns."""
    producer, consumer = pair
    run_request(producer, consumer, "warm", [0], consumer_first=False)  # the session
    hub = consumer.tier._control._hub  # type: ignore[attr-defined]
    flush, flushes = hub.flush, []

    def counted() -> None:
        flushes.append(1)
        flush()

    hub.flush = counted
    pctx, cctx = contexts("sent", producer)
    producer.tier.on_new_request(pctx)
    producer.job(1, [b"sent/0"], [1], load=False, ctx=pctx)
    consumer.tier.on_new_request(cctx)
    assert consumer.tier.lookup(b"sent/0", cctx) is LookupResult.HIT
    assert flushes == []
    consumer.job(2, [b"sent/0"], [2], load=True, ctx=cctx)  # a fetch: queued, flushed
    assert flushes == [1]
    wait_until(
        lambda: 2 in consumer.results, timeout=T, what="the load", pumps=[tick(producer, consumer)]
    )
    assert consumer.results[2].outcome is Outcome.DONE
