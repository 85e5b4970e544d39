"""A process with two tiers (zmq control, memory data) that exchange a few PD requests, with
p2pkv-prometheus loaded through its entry point, serving ``/metrics`` over HTTP: run in a
spawned child (``p2pkv.testing.child.Child``) by the scrape test."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection

_LIFETIME = 120.0
_BLOCK, _BLOCKS = 1024, 8


def serve(pipe: Connection, requests: int) -> None:
    """Run ``requests`` PD requests between the two tiers, then serve ``/metrics`` on an
    ephemeral port of 127.0.0.1; reports ``("port", port, outcomes)`` and serves until told
    to stop (or orphaned)."""
    import prometheus_client
    from p2pkv.config import TierConfig
    from p2pkv.tier import P2PTier
    from p2pkv.types import Job, RequestContext

    def tier() -> P2PTier:
        config = TierConfig.from_dict(
            {"control": "zmq", "data": "memory", "host": "127.0.0.1", "port": 0}
        )
        return P2PTier(config, memoryview(bytearray(_BLOCK * _BLOCKS)), _BLOCK)

    producer, consumer = tier(), tier()
    host, port = producer.local_address.rsplit(":", 1)
    outcomes: list[str] = []
    for n in range(requests):
        kv = f"scrape-{n}"
        store = RequestContext(f"p-{kv}", {"remote_decoder": {"kv_request_id": kv}})
        load = RequestContext(
            f"c-{kv}",
            {
                "remote_prefiller": {
                    "kv_request_id": kv,
                    "remote_host": host,
                    "remote_port": int(port),
                }
            },
        )
        producer.on_new_request(store)
        consumer.on_new_request(load)
        producer.submit_store(Job(2 * n, [b"k%d" % n], [n % _BLOCKS], False, store))
        consumer.submit_load(Job(2 * n + 1, [b"k%d" % n], [n % _BLOCKS], True, load))
        deadline = time.monotonic() + 30
        done = 0
        while done < 2 and time.monotonic() < deadline:
            for t in (producer, consumer):
                t.tick(0.001)
                for result in t.get_finished_jobs():
                    outcomes.append(result.outcome.value)
                    done += 1
        producer.on_request_finished(store)
        consumer.on_request_finished(load)
    server, _ = prometheus_client.start_http_server(0, addr="127.0.0.1")
    pipe.send(("port", server.server_port, outcomes))
    deadline = time.monotonic() + _LIFETIME
    while time.monotonic() < deadline and not pipe.poll(0.01):
        for t in (producer, consumer):
            t.tick(0.001)
    server.shutdown()
    for t in (producer, consumer):
        t.shutdown()
