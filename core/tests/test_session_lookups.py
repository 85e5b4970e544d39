"""Session tests: lookups, as the consumer probes and as the producer serves them.

Rig and fixtures: ``session_rig.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from p2pkv.protocol import Fetch, Lookup, LookupResp, Ready, Release
from p2pkv.types import Job, LookupResult, Outcome, RequestContext
from session_rig import Rig, as_round_failed


def test_symmetric_probes_batch_per_request_and_resolve(consumer: Rig) -> None:
    client = consumer.session.consumer
    assert client.probe("r", b"a") is LookupResult.RETRY
    assert client.probe("r", b"b") is LookupResult.RETRY
    assert client.probe("q", b"c") is LookupResult.RETRY
    client.flush_lookups()
    assert consumer.sent() == [Lookup(0, "r", [b"a", b"b"]), Lookup(1, "q", [b"c"])]
    client.flush_lookups()
    assert consumer.sent() == []
    assert client.probe("r", b"a") is LookupResult.RETRY
    consumer.feed(LookupResp(0, [True, False]))
    assert client.probe("r", b"a") is LookupResult.HIT
    assert client.probe("r", b"b") is LookupResult.MISS
    consumer.tick(10.1)  # lookup 1 never answered: MISS
    assert client.probe("q", b"c") is LookupResult.MISS
    consumer.feed(LookupResp(1, [True]))  # late: ignored
    assert client.probe("q", b"c") is LookupResult.MISS and consumer.doom() is None


@pytest.mark.parametrize(
    "resp, fragment",
    [
        (LookupResp(5, [True]), "lookup_resp.seq: 5 was never sent"),
        (LookupResp(0, [True, True]), "lookup_resp.hits: 2 answers for 1 keys"),
    ],
)
def test_bad_lookup_responses(consumer: Rig, resp: LookupResp, fragment: str) -> None:
    consumer.session.consumer.probe("r", b"a")
    consumer.session.consumer.flush_lookups()
    consumer.feed(resp)
    assert fragment in consumer.doomed().reason


def test_finish_after_probes_only_sends_the_terminal_fetch(consumer: Rig) -> None:
    consumer.session.consumer.probe("r", b"a")
    consumer.session.consumer.flush_lookups()
    consumer.sent()
    consumer.session.consumer.finish("r")
    assert consumer.sent() == [Fetch("r", 0, [])]
    assert consumer.session.consumer.state_sizes()["lookups"] == 0
    assert consumer.session.consumer.reqs == {}


def test_lookup_without_a_source_answers_all_miss_at_once(producer: Rig) -> None:
    producer.feed(Lookup(0, "r", [b"a", b"b"]))
    assert producer.sent() == [LookupResp(0, [False, False])]
    producer.feed(Lookup(0, "r", [b"a"]))
    assert "lookup.seq: 0 is not above the previous lookup 0" in producer.doomed().reason


class Source:
    def __init__(
        self, have: dict[bytes, int], retry: frozenset[bytes] = frozenset(), fail: str = ""
    ) -> None:
        self.have, self.retry, self.fail = have, set(retry), fail
        self.calls: list[str] = []

    def begin(self, kv: str) -> object:
        self.calls.append("begin")
        if self.fail == "begin":
            raise RuntimeError("begin failed")
        return kv

    def lookup(self, handle: object, key: bytes) -> LookupResult:
        if key in self.retry:
            return LookupResult.RETRY
        return LookupResult.HIT if key in self.have else LookupResult.MISS

    def pin(self, handle: object, keys: Sequence[bytes]) -> Job:
        self.calls.append("pin")
        if self.fail == "pin":
            raise RuntimeError("pin failed")
        return Job(500, keys, [self.have[k] for k in keys], False, RequestContext("pin"))

    def end(self, handle: object) -> None:
        self.calls.append("end")


def test_lookup_served_from_the_source_pins_hits_as_supply(consumer: Rig) -> None:
    rig = consumer
    rig.env.lookup_ends.source_seen = True
    rig.feed(Lookup(0, "r", [b"a", b"b", b"c"]))
    src = Source({b"a": 1, b"c": 3}, retry=frozenset({b"b"}))
    rig.session.producer.serve(src)
    assert rig.sent() == []  # b is still RETRY
    src.retry.clear()
    rig.session.producer.serve(src)
    assert rig.sent() == [LookupResp(0, [True, False, True])]
    assert src.calls == ["begin", "pin", "end"]
    rig.feed(Fetch("r", 0, [b"c", b"a"]))
    assert rig.sent() == [Ready("r", 0, [0, 1], [3, 1])]
    rig.feed(Fetch("r", 1, [b"zz"]))  # lookup-served: nothing more will come
    assert as_round_failed(rig.sent()[-1]).reason.startswith("demand_unmet")
    rig.feed(Release("r", 0, True))
    rig.take()
    assert rig.results == {500: Outcome.DONE}


@pytest.mark.parametrize("fail", ["begin", "pin"])
def test_hit_source_failures_answer_miss(consumer: Rig, fail: str) -> None:
    consumer.env.lookup_ends.source_seen = True
    consumer.feed(Lookup(0, "r", [b"a"]))
    src = Source({b"a": 1}, fail=fail)
    consumer.session.producer.serve(src)
    assert consumer.sent() == [LookupResp(0, [False])]
    assert src.calls[-1] == ("end" if fail == "pin" else "begin")


def test_lookup_deadline_without_serving_answers_miss_and_defers_end(consumer: Rig) -> None:
    consumer.env.lookup_ends.source_seen = True
    consumer.feed(Lookup(0, "r", [b"a"]))
    src = Source({}, retry=frozenset({b"a"}))
    consumer.session.producer.serve(src)
    consumer.tick(5.1)
    assert consumer.sent() == [LookupResp(0, [False])]
    assert consumer.env.lookup_ends.take() == ["r"]


def test_an_oversize_lookup_answers_its_keys_miss(consumer: Rig) -> None:
    consumer.conn.max_frame = 64
    client = consumer.session.consumer
    for i in range(4):
        assert client.probe("r", bytes([i]) * 20) is LookupResult.RETRY
    client.flush_lookups()
    assert consumer.sent() == [] and consumer.doom() is None
    assert client.state_sizes()["lookups"] == 0
    assert client.probe("r", b"\x00" * 20) is LookupResult.MISS
