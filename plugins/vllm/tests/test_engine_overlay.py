"""The shipped llm-d overlay on real engines: the guide's ``"type": "p2p"`` entry, the
overlay's environment (zero-edit mode, the fleet's CURVE keys from one directory, the peers
the tier may dial and the ones it connects to before any request) and the connector keys
of its ``--kv-transfer-config``, taken from ``kubectl kustomize deploy/llm-d/overlay``
(:mod:`overlay` lists the few values a cluster or the CPU platform fills in). PD in both
arrival orders and a prefix pull between the two, as ``test_engine_pd`` runs its rows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine
pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="needs vLLM (nox -s engine)")
pytest.importorskip("nixl._api", reason="needs NIXL (installed lean by nox -s engine)")
pytest.importorskip("yaml", reason="needs PyYAML (vLLM's dependency) to read the overlay")

from engine_kit import Engine, free_port, running  # noqa: E402
from overlay import engine_settings, render  # noqa: E402
from p2pkv_zmq.keys import write_fleet_keys  # noqa: E402
from test_engine_pd import (  # noqa: E402, F401 - the tests run again on the overlay's pair
    Pair,
    ref,
    reference,
    test_decoder_first,
    test_prefiller_first,
    test_symmetric_a_busy_source_shares_its_prefix,
)


@pytest.fixture(scope="module")
def pair(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """A prefiller and a decoder configured by the rendered overlay."""
    try:
        render()
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"cannot render the overlay: {exc}")
    keys = tmp_path_factory.mktemp("curve")
    write_fleet_keys(Path(keys))
    ports = [free_port(), free_port()]
    engines = []
    for name, port in zip(("pre", "dec"), ports, strict=True):
        tier, connector, env = engine_settings(port, ports, Path(keys))
        engines.append(Engine(name, tiny_model, tier, env, extra=connector))
    with running(*engines) as (pre, dec):
        assert pre.runs_p2pkv and dec.runs_p2pkv
        yield pre, dec
