"""The back-pressure rule without vLLM: PD stores are never dropped, offers are vLLM's call."""

from __future__ import annotations

from p2pkv_vllm.backpressure import PDSafeDetector


class _Detector:
    def __init__(self) -> None:
        self.asked: list[int] = []
        self.stats = {"ema": 1.0}

    def should_store(self, num_blocks: int) -> bool:
        self.asked.append(num_blocks)
        return False  # under pressure: drop


def test_offers_follow_the_detector_and_pd_stores_always_go() -> None:
    inner, pd = _Detector(), [False]
    detector = PDSafeDetector(inner, lambda: pd[0])
    assert detector.should_store(3) is False and inner.asked == [3]
    pd[0] = True
    assert detector.should_store(5) is True and inner.asked == [3]  # not even asked
    assert detector.stats == {"ema": 1.0}  # everything else is the detector's
