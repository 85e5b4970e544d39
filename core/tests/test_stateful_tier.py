"""Stateful property test: two and three P2PTiers over fault-injected memory transports.

The machine is the conformance kit's transport-parameterised
:class:`p2pkv.testing.tier_machine.TierMachine` (its docstring lists the rules and the
invariants; ``tests/conformance`` runs the same machine over zmq + nixl and zmq + ucx). Here it
runs over the memory transports wrapped by ``FaultInjector`` (dropped, delayed, duplicated and
reordered frames, failed submits and completions, killed connections, partitions, restarts),
with per-node write latencies: like an engine, the model reuses every slot as soon as its load
has a result, also after PEER_DEAD or ABORT_ACK_TIMEOUT, while the producer's write into it may
still be in flight (the memory data transport completes writes polls later, and with
``wait_cancel_refuses`` a dead session's writes keep landing): a load reported DONE must still
hold exactly its own bytes then and ever after (the tier fences such slots until the producer
confirms).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test
from p2pkv.testing.tier_machine import TierMachine
from p2pkv_memory.control import MemoryControlTransport
from p2pkv_memory.data import MemoryDataTransport

DEEP = os.environ.get("HYPOTHESIS_PROFILE") == "deep"


class MemoryTiers(TierMachine):
    control_transport = MemoryControlTransport
    data_transport = MemoryDataTransport
    faults_enabled = True
    num_blocks = 96
    block_len = 8

    def draw_data_options(self, data: st.DataObject) -> list[Mapping[str, Any]]:
        """Per node: how many polls its writes take (a slow node's writes outlive a cut and
        land after a fast node served the same slots again)."""
        polls = data.draw(st.lists(st.sampled_from([0, 1, 2, 12]), min_size=self.N_NODES,
                                   max_size=self.N_NODES), label="completion_polls")
        refuse = data.draw(st.booleans(), label="wait_cancel_refuses")
        return [{"completion_polls": n, "wait_cancel_refuses": refuse} for n in polls]


class TwoTiers(MemoryTiers):
    N_NODES = 2


class ThreeTiers(MemoryTiers):
    N_NODES = 3


def _settings(examples: int, steps: int) -> settings:
    scale = 10 if DEEP else 1
    return settings(max_examples=examples * scale, stateful_step_count=steps, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.filter_too_much])


@pytest.mark.hypothesis
@pytest.mark.timeout(3600 if DEEP else 120)
@pytest.mark.parametrize("machine, examples", [(TwoTiers, 30), (ThreeTiers, 20)],
                         ids=["two", "three"])
def test_tiers_keep_their_promises_under_faults(machine: type, examples: int) -> None:
    run_state_machine_as_test(machine, settings=_settings(examples, 60))
