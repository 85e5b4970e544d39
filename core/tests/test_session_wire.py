"""Session tests: two sessions talking to each other, and our own frames over the size cap.

Rig and fixtures: ``session_rig.py``.
"""

from __future__ import annotations

import pytest
from p2pkv.errors import FrameTooLarge, ProtocolError
from p2pkv.protocol import Fetch, Ready, Release, encode
from p2pkv.types import Outcome
from session_rig import OUR_BLOCKS, PEER, Rig, as_round_failed


def _pair() -> tuple[Rig, Rig]:
    """A consumer and a producer session talking to each other (both see the other as PEER)."""
    c = Rig(address=PEER, peer_blocks=OUR_BLOCKS)
    p = Rig(address=PEER, peer_blocks=OUR_BLOCKS)
    _shuttle(c, p)
    assert c.session.ready and p.session.ready
    return c, p


def _shuttle(a: Rig, b: Rig) -> None:
    while a.conn.sent or b.conn.sent:
        for src, dst in ((a, b), (b, a)):
            frames, src.conn.sent = src.conn.sent, []
            dst.conn.inbox.extend(frames)
            dst.session.receive()
            dst.take()


@pytest.mark.parametrize("ok", [True, False])
def test_a_load_end_to_end(ok: bool) -> None:
    c, p = _pair()
    p.dir.producer_started("r")
    p.store(1, "r", [b"a", b"b"], [10, 11])
    c.load(1, "r", [b"b", b"a"], [3, 4])
    _shuttle(c, p)
    assert c.data.posted == [(PEER, [3, 4], [11, 10])]
    (rid,) = c.data.reads
    c.finish_read(rid, ok)
    _shuttle(c, p)
    if ok:
        assert c.results == {1: Outcome.DONE} and p.results == {1: Outcome.DONE}
    else:
        assert c.results == {1: Outcome.TRANSFER_FAILED} and p.results == {1: Outcome.ABORTED}
    c.session.consumer.finish("r")
    p.dir.producer_finished("r")
    p.session.producer.producer_finished("r")
    _shuttle(c, p)
    assert p.session.producer.reqs == {} and p.dir.bound("r") is None
    assert c.session.consumer.reqs == {} and p.session.wound_down and c.session.wound_down
    assert c.doom() is None and p.doom() is None


@pytest.mark.parametrize("error", [FrameTooLarge, ProtocolError])  # ProtocolError: older
def test_an_oversize_fetch_fails_its_load_not_the_session(
    consumer: Rig, error: type[Exception]
) -> None:
    consumer.conn.max_frame, consumer.conn.too_large = 64, error
    consumer.load(1, "r", [b"k" * 40, b"j" * 40], [0, 1])
    assert consumer.results == {1: Outcome.SUBMIT_FAILED}
    assert "larger than a frame" in consumer.details[1]
    assert consumer.sent() == [] and consumer.doom() is None and "r" in consumer.env.failed_loads
    consumer.load(2, "q", [b"a"], [2])
    assert consumer.sent() == [Fetch("q", 0, [b"a"])]


def test_an_oversize_ready_fails_the_round_and_keeps_the_pins_until_release(producer: Rig) -> None:
    keys = [b"%02d" % i for i in range(60)]
    producer.store(1, "r", keys, list(range(60)))
    producer.conn.max_frame = 150  # a round_failed fits, a ready for 60 blocks does not
    assert len(encode(Ready("r", 0, list(range(60)), list(range(60))))) > 150
    producer.feed(Fetch("r", 0, keys))
    (msg,) = producer.sent()
    assert as_round_failed(msg).outcome == "submit_failed" and producer.doom() is None
    assert producer.session.producer.n_pins == 60 and producer.results == {}
    producer.feed(Release("r", 0, False))
    assert producer.session.producer.n_pins == 0 and producer.results == {1: Outcome.ABORTED}
