"""Conventions shared by the plugins that export p2pkv's metrics.

``p2pkv-prometheus`` and ``p2pkv-vllm`` export the same quantities under two families
(``p2pkv_*`` and ``vllm:kv_offload_p2pkv_*``, docs/observability.md). Both take their
histogram buckets from here, so the two families' histograms compare bucket for bucket.
This module imports nothing and holds no state.
"""

from __future__ import annotations

LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
)
"""Upper bounds in seconds of every latency histogram (jobs and transfers), ``+Inf`` implied.

The low end resolves a single block read over shared memory or RDMA (under a millisecond).
The high end is the default load and store timeouts (30 s), where a job ends anyway. A
store's duration includes the wait for its consumer, so stores fill the upper buckets."""
