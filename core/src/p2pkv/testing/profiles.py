"""The kit's recommended hypothesis settings: a failing state machine reports in seconds.

Hypothesis' own defaults (100 examples of up to 50 steps, then shrinking) make a broken
transport take minutes to report through a state machine, and an author's package never loads
this repository's profiles. So the kit registers the hypothesis profile ``p2pkv`` (on import of
:mod:`p2pkv.testing.stateful`, :mod:`p2pkv.testing.tier_machine` and the kit's pytest plugin,
so ``pytest --hypothesis-profile p2pkv`` works), and its machines run with it by default:
:func:`machine_settings` is what a machine subclass gets as ``TestCase.settings`` when it is
defined while hypothesis' ``default`` profile is the loaded one (see
:class:`p2pkv.testing.machine.KitMachine`). Loading a profile of your own
before the class is defined (a ``conftest.py``, ``--hypothesis-profile``), setting
``TestCase.settings`` or passing ``settings=`` to ``run_state_machine_as_test`` wins.

The profile: few, short runs, no shrinking (a failing run prints its unshrunk steps, at most
``stateful_step_count`` of them), no per-example deadline (timings are not behaviour), random
(repeated runs explore more; hypothesis' example database replays a failure).
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings

__all__ = ["PROFILE", "machine_settings"]

PROFILE = "p2pkv"

settings.register_profile(
    PROFILE,
    max_examples=20,
    stateful_step_count=25,
    deadline=None,
    phases=[p for p in Phase if p not in (Phase.shrink, Phase.explain)],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    report_multiple_bugs=False,
)


def machine_settings() -> settings:
    """The settings a kit machine runs with unless told otherwise: the ``p2pkv`` profile
    while hypothesis' ``default`` profile is loaded, else the loaded profile (with no
    per-example deadline)."""
    if settings.get_current_profile_name() == "default":
        return settings.get_profile(PROFILE)
    return settings(settings.default, deadline=None)
