"""The proxy's routing decisions as Prometheus metrics (``GET /metrics``, text format 0.0.4).

Rendered from the prefix router's counters on each scrape, without prometheus_client (the
proxy does not depend on it). Names and meaning (also on docs/observability.md):

``p2pkv_proxy_prefix_decisions_total``
    Requests routed by a prefix policy.
``p2pkv_proxy_prefix_decisions_with_source_total``
    Of those, the ones given a ``remote_kv_source``.
``p2pkv_proxy_prefix_lookups_total{outcome}``
    Prefix lookups by outcome (``hit``, ``miss``, ``no_tokens``, ``timeout``, ...).
``p2pkv_proxy_prefix_matched_tokens_total`` / ``p2pkv_proxy_prefix_source_tokens_total``
    Prompt tokens cached on the chosen prefiller / on the named source, summed.

Threading: called on the proxy's event loop, like the router that owns the counters.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["METRICS", "render"]

_PREFIX = "p2pkv_proxy_prefix_"
METRICS: Mapping[str, str] = {
    f"{_PREFIX}decisions_total": "Requests routed by a prefix policy.",
    f"{_PREFIX}decisions_with_source_total": "Prefix-routed requests given a remote_kv_source.",
    f"{_PREFIX}lookups_total": "Prefix lookups by outcome.",
    f"{_PREFIX}matched_tokens_total": "Prompt tokens cached on the chosen prefiller, summed.",
    f"{_PREFIX}source_tokens_total": "Prompt tokens cached on the named source, summed.",
}
"""Every metric ``render`` writes, with its help text."""
_FROM_COUNTER = {
    f"{_PREFIX}decisions_total": "decisions",
    f"{_PREFIX}decisions_with_source_total": "with_source",
    f"{_PREFIX}matched_tokens_total": "matched_tokens",
    f"{_PREFIX}source_tokens_total": "source_tokens",
}
_LOOKUP = "lookup_"


def render(counters: Mapping[str, int]) -> str:
    """The exposition text for the router's ``counters`` (see the module docstring)."""
    lines: list[str] = []
    for name, help_text in METRICS.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
        if name == f"{_PREFIX}lookups_total":
            lines += [
                f'{name}{{outcome="{key[len(_LOOKUP) :]}"}} {value}'
                for key, value in sorted(counters.items())
                if key.startswith(_LOOKUP)
            ]
        else:
            lines.append(f"{name} {counters.get(_FROM_COUNTER[name], 0)}")
    return "\n".join(lines) + "\n"
