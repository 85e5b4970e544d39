"""A flood of client-named peers does not make a tick or a name dearer (issue 48, item 5).

One consumer tier (memory transports, fake clock, default ``peers``) is flooded with PD
requests naming silent addresses: each spends a dial of the budget or waits in the dial
queue, and never answers. The work is counted as Python calls (``sys.setprofile``), never
timed. With a flood of 10,000 names (64 dials that heard nothing, 256 peers waiting, the
rest dropped from the queue) a tick costs at most :data:`FACTOR` times the calls it costs
with 10 peers waiting, and so does one more flood name. Measured: 67 and 77 calls a tick,
116 and 146 a name (each name then drops an older one from the queue). So a tick walks no
waiting peer, load or dial, and the queue's bound keeps a name's cost flat.
"""

from __future__ import annotations

from p2pkv.testing.harness import Cluster, Node
from p2pkv.types import RequestContext
from test_idle_cost import calls

FACTOR = 1.5
"""A flooded tier's calls per tick, or per new name, at most this many times a quiet one's."""
DIALS = 64
"""Dials that heard nothing, open at once (a quarter of the default ``peers.max_dialed``)."""
TICKS = 40
NAMES = 50


def flood_name(node: Node, i: int) -> None:
    """A PD request naming a silent address (its own for ``i`` >= 1), with a one-block load."""
    host = f"127.{1 + i // 65536}.{(i // 256) % 256}.{i % 256 or 1}"
    ctx = RequestContext(
        f"flood-{i}",
        {
            "remote_prefiller": {
                "kv_request_id": f"flood-{i}",
                "remote_host": host,
                "remote_port": 9,
            }
        },
    )
    node.tier.on_new_request(ctx)
    node.load(1_000_000 + i, [f"f{i}".encode()], [i % 60], ctx)


def flooded(cluster: Cluster, names: int) -> tuple[float, float]:
    """A consumer flooded with ``names`` silent names: (calls per tick, calls per new name)."""
    node = cluster(control_options={"connect_timeout": 3600})
    for i in range(1, names + 1):
        flood_name(node, i)
    stats = node.tier.stats()
    assert stats["peers_dialing"] == DIALS, stats
    assert stats["peers_waiting"] == min(names - DIALS, 4 * DIALS), stats

    def ticks() -> None:
        for _ in range(TICKS):  # a tick every 2 ms: the budget's tokens and the waits fall due
            node.clock.advance(0.002)
            node.tier.tick()

    def more() -> None:
        for i in range(names + 1, names + NAMES + 1):
            flood_name(node, i)

    return calls(ticks) / TICKS, calls(more) / NAMES


def test_a_flood_of_10000_names_costs_a_tick_and_a_name_what_10_cost(
    cluster: Cluster,
) -> None:
    tick_10, name_10 = flooded(cluster, DIALS + 10)
    tick_flood, name_flood = flooded(cluster, 10_000)
    assert tick_flood <= FACTOR * tick_10, (tick_10, tick_flood)
    assert name_flood <= FACTOR * name_10, (name_10, name_flood)
