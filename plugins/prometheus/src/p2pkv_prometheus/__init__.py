"""Prometheus metrics for p2pkv (see README). The plugin module is ``p2pkv_prometheus.plugin``."""

from p2pkv_prometheus.metrics import Metrics

__all__ = ["Metrics"]
