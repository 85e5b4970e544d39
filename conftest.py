"""Repository-wide pytest setup: hypothesis profiles.

``ci`` (default) keeps property tests fast; ``deep`` (``HYPOTHESIS_PROFILE=deep``, used by
``nox -s deep``) runs 20x the examples. Neither has a per-example deadline: the machine is
shared and timings are not behaviour.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "deep", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
