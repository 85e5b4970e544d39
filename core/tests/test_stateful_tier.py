"""Stateful property test: two and three P2PTiers over fault-injected memory transports.

The machine is the conformance kit's transport-parameterised
:class:`p2pkv.testing.tier_machine.TierMachine` (its docstring lists the rules and the
invariants; ``tests/conformance`` runs the same machine over zmq + nixl and zmq + ucx). Here it
runs over the memory transports wrapped by ``FaultInjector`` (dropped, delayed, duplicated and
reordered frames, failed submits and completions, killed connections, partitions, restarts,
frozen nodes), with per-node read latencies: like an engine, the model reuses every slot as
soon as its load has a result, whatever the outcome, and a slot must never change after its
result (the consumer owns every write into its region: its reads are cancelled, finally,
before any failure is reported).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test
from p2pkv.reference.control import MemoryControlTransport
from p2pkv.reference.data import MemoryDataTransport
from p2pkv.testing.tier_machine import TierMachine

DEEP = os.environ.get("HYPOTHESIS_PROFILE") == "deep"


class MemoryTiers(TierMachine):
    control_transport = MemoryControlTransport
    data_transport = MemoryDataTransport
    faults_enabled = True
    num_blocks = 96
    block_len = 8

    def draw_data_options(self, data: st.DataObject) -> list[Mapping[str, Any]]:
        """Per node: how many polls its reads take (a slow node's reads outlive a cut, a
        freeze or a load deadline, and must then never land), and how many blocks its reads
        may have in flight at once (0: unbounded; else a window-limited transport whose
        reads wait in the tier's read gate)."""
        n = self.N_NODES
        polls = data.draw(
            st.lists(st.sampled_from([0, 1, 2, 12]), min_size=n, max_size=n),
            label="completion_polls",
        )
        capacity = data.draw(
            st.lists(st.sampled_from([0, 0, 1, 3, 8]), min_size=n, max_size=n),
            label="read_capacity",
        )
        return [
            {"completion_polls": p, "read_capacity": c}
            for p, c in zip(polls, capacity, strict=True)
        ]


class TwoTiers(MemoryTiers):
    N_NODES = 2


class ThreeTiers(MemoryTiers):
    N_NODES = 3


def _settings(examples: int, steps: int) -> settings:
    scale = 10 if DEEP else 1
    return settings(
        max_examples=examples * scale,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


@pytest.mark.hypothesis
@pytest.mark.timeout(3600 if DEEP else 120)
@pytest.mark.parametrize(
    "machine, examples", [(TwoTiers, 30), (ThreeTiers, 20)], ids=["two", "three"]
)
def test_tiers_keep_their_promises_under_faults(machine: type, examples: int) -> None:
    run_state_machine_as_test(machine, settings=_settings(examples, 60))
