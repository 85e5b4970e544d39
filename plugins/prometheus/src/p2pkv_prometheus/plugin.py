"""p2pkv plugin: observer hooks -> Prometheus metrics.

Hooks run on the tier's driver thread; each does a few counter updates and nothing else.
In multi-process mode a process's gauges go away when it exits (``liveness``).
"""

from __future__ import annotations

from p2pkv.hookspecs import hookimpl

from p2pkv_prometheus.liveness import watch_exit
from p2pkv_prometheus.metrics import Metrics

P2PKV_PLUGIN_API = 1

_metrics: Metrics | None = None


def metrics() -> Metrics:
    """The metrics of this process (created in the default registry on first use)."""
    global _metrics
    if _metrics is None:
        _metrics = Metrics()
    return _metrics


def _reason_class(reason: str) -> str:
    head = reason.strip().split(":", 1)[0].split()
    return head[0][:40] if head else "unknown"


@hookimpl
def p2pkv_session_opened(peer: str, local: str) -> None:
    metrics().sessions_opened.inc()


@hookimpl
def p2pkv_session_closed(peer: str, reason: str) -> None:
    metrics().sessions_closed.labels(reason=_reason_class(reason)).inc()


@hookimpl
def p2pkv_handshake_rejected(peer: str, reason: str) -> None:
    metrics().rejections.inc()


@hookimpl
def p2pkv_protocol_error(peer: str, reason: str) -> None:
    metrics().protocol_errors.inc()


@hookimpl
def p2pkv_transfer_finished(
    peer: str, transfer_id: int, success: bool, nbytes: int, seconds: float
) -> None:
    m = metrics()
    m.transfer(success).inc()
    if success:
        m.bytes_read.inc(nbytes)
    m.transfer_seconds.observe(seconds)


@hookimpl
def p2pkv_job_finished(
    job_id: int, is_load: bool, outcome: str, kv_request_id: str, peer: str, seconds: float
) -> None:
    jobs, job_seconds = metrics().job("load" if is_load else "store", outcome)
    jobs.inc()
    job_seconds.observe(seconds)


@hookimpl
def p2pkv_timeout(kind: str, kv_request_id: str, peer: str) -> None:
    metrics().timeouts.labels(kind=kind).inc()


@hookimpl
def p2pkv_tier_state(in_flight_transfers: int, parked_stores: int, sessions: int) -> None:
    m = metrics()
    watch_exit()
    m.in_flight.set(in_flight_transfers)
    m.parked.set(parked_stores)
    m.sessions.set(sessions)
