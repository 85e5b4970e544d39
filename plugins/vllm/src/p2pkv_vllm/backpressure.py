"""vLLM's store back-pressure, limited to what this tier may safely drop.

vLLM 0.33 lets a ``secondary_tiers`` entry (or ``kv_connector_extra_config``) carry a
``backpressure`` block: the tier gets a detector (an EMA of its store latency and a policy)
and vLLM's tiering manager asks ``detector.should_store(num_blocks)`` before every store it
would submit to the tier, dropping the store when the answer is no. For p2pkv a store is one
of two things:

- a **PD store** of a prefiller: its decoder waits for those blocks. Dropping it would leave
  the decoder waiting out its load timeout (30 s by default) before it recomputes, so such a
  store is never dropped;
- an **offer** of a symmetric (prefix-sharing) instance: opportunistic, nobody waits for it;
  dropping it under pressure only costs a later prefix hit. vLLM's policy decides those.

vLLM's question carries no request, so the rule is per moment: while the tier has a PD
producer request open, every store goes; otherwise the detector's policy decides. On a pure
prefix-sharing instance that is vLLM's own back-pressure; on a prefiller it is off while it
serves PD requests (docs/vllm.md, "Back-pressure").

Threading: called by vLLM's manager on the engine thread, like the tier's own methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["PDSafeDetector"]


class PDSafeDetector:
    """Wraps vLLM's ``BackpressureDetector``: ``should_store`` says yes while ``pd_open()``
    (a PD producer request is open on the tier), else asks the detector; every other
    attribute (``update``, ``on_store_failed``, ``reset``, ``stats``, ...) is the
    detector's."""

    def __init__(self, detector: Any, pd_open: Callable[[], bool]) -> None:
        self._detector = detector
        self._pd_open = pd_open

    def should_store(self, num_blocks: int) -> bool:
        if self._pd_open():
            return True
        return bool(self._detector.should_store(num_blocks))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._detector, name)
