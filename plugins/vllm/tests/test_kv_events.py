"""The KV-event subscriber against publishers speaking vLLM's wire format over loopback TCP.

``VLLMStylePublisher`` follows vLLM 0.33's documented protocol: PUB ``[topic, seq, payload]``
with an 8-byte big-endian seq from 0, a replay ROUTER answering ``[b"", start]`` with every
buffered batch ``>= start`` and the end marker. Ports come from binding 0. Every wait is a
bounded poll loop.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq
from p2pkv.testing.waiting import wait_until
from p2pkv_vllm.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    endpoint_for_rank,
)
from p2pkv_vllm.kv_subscriber import Batch, KVEventSubscriber, Reset, Update

WAIT = 10.0


def _bind(sock: zmq.Socket[bytes], port: int) -> str:
    """Bind ``sock`` on 127.0.0.1:``port`` (0: any); the endpoint. A given port is retried,
    bounded: a socket closed on it just before (a publisher restart) is released by libzmq's
    I/O thread asynchronously."""

    def bound() -> bool:
        try:
            sock.bind(f"tcp://127.0.0.1:{port}")
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or not port:
                raise
            return False
        return True

    wait_until(bound, timeout=WAIT, what=f"port {port} to be released")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class VLLMStylePublisher:
    """PUB + replay ROUTER on 127.0.0.1; the ROUTER is served by its own thread."""

    def __init__(self, *, buffer_steps: int = 100, pub_port: int = 0, replay_port: int = 0) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self.endpoint = _bind(self._pub, pub_port)
        self._router = self._ctx.socket(zmq.ROUTER)
        self.replay_endpoint = _bind(self._router, replay_port)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._seq = 0
        self.replay_requests: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch, *, drop: bool = False) -> int:
        """Publish the next batch (``drop``: buffer it for replay but lose it on PUB)."""
        seq, payload = self._seq, encode_batch(batch)
        self._seq += 1
        with self._lock:
            self._buffer.append((seq, payload))
        if not drop:
            self._pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        return seq

    def close(self) -> None:
        self._stop.set()
        self._thread.join(WAIT)
        self._pub.close(linger=0)
        self._router.close(linger=0)

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(20):
                continue
            client, _, start_bytes = self._router.recv_multipart()
            start = int.from_bytes(start_bytes, "big")
            self.replay_requests.append(start)
            with self._lock:
                replay = [(s, p) for s, p in self._buffer if s >= start]
            for seq, payload in replay:
                self._router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), payload])
            self._router.send_multipart([client, b"", b"", END_SEQ, b""])


def stored(n: int) -> KVEventBatch:
    return KVEventBatch(
        ts=time.time(),
        events=[
            BlockStored(
                block_hashes=[n],
                parent_block_hash=None,
                token_ids=[n] * 4,
                block_size=4,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
        ],
    )


def collect_until(
    sub: KVEventSubscriber,
    done: Callable[[list[Update]], bool],
    nudge: Callable[[], object] | None = None,
) -> list[Update]:
    """Poll ``sub`` (calling ``nudge`` between polls) until ``done(updates)``, bounded."""
    updates: list[Update] = []
    deadline = time.monotonic() + WAIT
    while not done(updates):
        assert time.monotonic() < deadline, f"timed out; got {updates}"
        if nudge is not None:
            nudge()
        updates.extend(sub.poll(0.05))
    return updates


def seqs(updates: list[Update]) -> list[int]:
    return [u.seq for u in updates if isinstance(u, Batch)]


@pytest.fixture
def publisher() -> Iterator[VLLMStylePublisher]:
    pub = VLLMStylePublisher()
    yield pub
    pub.close()


def joined(pub: VLLMStylePublisher, sub: KVEventSubscriber) -> list[Update]:
    """Publish until the subscriber hears something (slow joiner), bounded."""
    return collect_until(sub, lambda u: bool(u), lambda: pub.publish(stored(0)))


def test_wire_format_round_trips_and_rejects_bad_payloads() -> None:
    batch = KVEventBatch(
        ts=1.0,
        events=[
            BlockStored(
                block_hashes=[b"\x01" * 32, 7],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4],
                block_size=2,
                lora_id=None,
                medium="CPU",
                lora_name=None,
            ),
            BlockRemoved(block_hashes=[7], medium="CPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=1,
    )
    raw = encode_batch(batch)
    assert msgspec.msgpack.decode(raw)[1][1] == {
        "type": "BlockRemoved",
        "block_hashes": [7],
        "medium": "CPU",
    }
    assert decode_batch(raw) == batch
    bad = msgspec.msgpack.encode([1.0, [{"type": "BlockMoved", "block_hashes": []}], 0])
    with pytest.raises(msgspec.ValidationError):
        decode_batch(bad)
    strict = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": ["x"], "medium": None}], 0]
    )
    with pytest.raises(msgspec.ValidationError):
        decode_batch(strict)
    newer = msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared", "future": 1}]])
    assert decode_batch(newer).events == [AllBlocksCleared()]


def test_endpoints_follow_the_dp_rank_like_vllm() -> None:
    assert endpoint_for_rank("tcp://10.0.0.1:5557", 0) == "tcp://10.0.0.1:5557"
    assert endpoint_for_rank("tcp://10.0.0.1:5557", 3) == "tcp://10.0.0.1:5560"
    assert endpoint_for_rank("tcp://[::1]:0", 2) == "tcp://[::1]:0"
    assert endpoint_for_rank("inproc://ev", 1) == "inproc://ev_dp1"
    with pytest.raises(ValueError):
        endpoint_for_rank("ipc:///tmp/ev", 1)


def test_late_joiner_catches_up_from_the_replay_buffer(publisher: VLLMStylePublisher) -> None:
    for n in range(5):
        publisher.publish(stored(n))  # before anyone listens: PUB drops them
    sub = KVEventSubscriber(publisher.endpoint, publisher.replay_endpoint)
    try:
        updates = joined(publisher, sub)
        last = seqs(updates)[-1]
        assert seqs(updates) == list(range(last + 1))
        assert publisher.replay_requests[0] == 0
        assert sub.stats.lost == 0 and sub.stats.replayed >= 5
    finally:
        sub.close()


def test_gaps_are_filled_by_replay_in_order(publisher: VLLMStylePublisher) -> None:
    sub = KVEventSubscriber(publisher.endpoint, publisher.replay_endpoint)
    try:
        first = seqs(joined(publisher, sub))[-1]
        dropped = [publisher.publish(stored(n), drop=True) for n in range(3)]
        live = publisher.publish(stored(9))
        updates = collect_until(sub, lambda u: live in seqs(u))
        assert seqs(updates) == [*dropped, live] == list(range(first + 1, live + 1))
        assert publisher.replay_requests[-1] == dropped[0]
        assert sub.stats.lost == 0
    finally:
        sub.close()


def test_unfillable_gaps_are_counted_as_lost() -> None:
    pub = VLLMStylePublisher(buffer_steps=2)
    sub = KVEventSubscriber(pub.endpoint)  # no replay endpoint: nothing to fill with
    try:
        first = seqs(joined(pub, sub))[-1]
        for n in range(4):
            pub.publish(stored(n), drop=True)
        live = pub.publish(stored(9))
        updates = collect_until(sub, lambda u: live in seqs(u))
        assert seqs(updates) == [live] and live == first + 5
        assert sub.stats.lost == 4
    finally:
        sub.close()
        pub.close()


def test_gap_beyond_the_replay_buffer_delivers_what_is_left() -> None:
    small = VLLMStylePublisher(buffer_steps=2)
    sub = KVEventSubscriber(small.endpoint, small.replay_endpoint)
    try:
        first = seqs(joined(small, sub))[-1]
        for n in range(5):
            small.publish(stored(n), drop=True)
        live = small.publish(stored(9))
        updates = collect_until(sub, lambda u: live in seqs(u))
        assert seqs(updates) == [live - 1, live]  # the buffer kept the newest two
        assert sub.stats.lost == live - first - 2
    finally:
        sub.close()
        small.close()


def test_publisher_restart_resets_and_replays_the_new_stream() -> None:
    old = VLLMStylePublisher()
    sub = KVEventSubscriber(old.endpoint, old.replay_endpoint)
    try:
        joined(old, sub)
        last = [old.publish(stored(n)) for n in range(5)][-1]
        collect_until(sub, lambda u: last in seqs(u))
        pub_port = int(old.endpoint.rpartition(":")[2])
        replay_port = int(old.replay_endpoint.rpartition(":")[2])
        old.close()
        new = VLLMStylePublisher(pub_port=pub_port, replay_port=replay_port)
        try:
            updates = collect_until(
                sub,
                lambda u: any(isinstance(x, Reset) for x in u) and bool(seqs(u)),
                lambda: new.publish(stored(1)),
            )
            after = updates[[isinstance(x, Reset) for x in updates].index(True) + 1 :]
            assert seqs(after) == list(range(len(seqs(after))))  # from 0, consecutive
            assert sub.stats.restarts == 1
        finally:
            new.close()
    finally:
        sub.close()


def test_replay_timeout_is_bounded_and_counted() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:0")
    silent = ctx.socket(zmq.ROUTER)  # accepts the request, never answers
    silent.bind("tcp://127.0.0.1:0")
    sub = KVEventSubscriber(
        pub.getsockopt_string(zmq.LAST_ENDPOINT),
        silent.getsockopt_string(zmq.LAST_ENDPOINT),
        replay_timeout=0.2,
    )
    try:
        payload = encode_batch(stored(1))
        began = time.monotonic()
        updates = collect_until(
            sub, bool, lambda: pub.send_multipart([b"", (7).to_bytes(8, "big"), payload])
        )
        assert time.monotonic() - began < WAIT
        assert seqs(updates)[0] == 7 and sub.stats.replay_failures >= 1
        assert sub.stats.lost >= 7
    finally:
        sub.close()
        pub.close(linger=0)
        silent.close(linger=0)


@pytest.mark.vllm
def test_against_vllms_own_publisher(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's ZmqEventPublisher (when vLLM is installed: ``nox -s vllm`` and each
    ``vllm_release`` session, 0.27.1-0.33) is decoded by our subscriber, its replay
    included (every release in that range sends the topic frame on replay too)."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")  # tcp://*:0 binds the node IP
    from engine_kit import free_port  # vLLM 0.30 cannot bind port 0 ("tcp://*:0")

    vpub = kv_events.ZmqEventPublisher(
        0, endpoint=f"tcp://*:{free_port()}", replay_endpoint=f"tcp://*:{free_port()}"
    )
    config = vpub.get_publisher_config()
    # 0.30 reports its bind addresses ("tcp://*:port"), later releases resolved ones
    sub = KVEventSubscriber(
        config.endpoint.replace("*", "127.0.0.1"), config.replay_endpoint.replace("*", "127.0.0.1")
    )
    try:

        def nudge() -> None:
            vpub.publish(
                kv_events.KVEventBatch(
                    ts=1.0,
                    events=[
                        kv_events.BlockStored(
                            block_hashes=[b"h" * 32],
                            parent_block_hash=None,
                            token_ids=[1, 2],
                            block_size=2,
                            lora_id=None,
                            medium="GPU",
                            lora_name=None,
                        )
                    ],
                )
            )

        updates = collect_until(sub, bool, nudge)
        batch = next(u for u in updates if isinstance(u, Batch)).batch
        assert isinstance(batch.events[0], BlockStored) and batch.data_parallel_rank == 0
        assert seqs(updates) == list(range(len(seqs(updates))))  # replayed from 0
    finally:
        sub.close()
        vpub.shutdown()
