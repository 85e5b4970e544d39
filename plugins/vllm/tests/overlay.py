"""The shipped llm-d overlay (``deploy/llm-d/overlay``), rendered with ``kubectl kustomize``,
as test engines run it: its model server's ``--kv-transfer-config`` and environment, with
only what names the cluster or the GPU platform replaced (:func:`engine_settings` lists
each), so the overlay cannot drift from what the engine tests prove works."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["OVERLAY", "EngineSettings", "engine_settings", "probe_command", "render"]

OVERLAY = Path(__file__).resolve().parents[3] / "deploy" / "llm-d" / "overlay"
_REF = re.compile(r"\$\((\w+)\)")

EngineSettings = tuple[dict[str, Any], dict[str, Any], dict[str, str]]
"""(tier entry, other connector keys, environment) of one test engine."""


def render() -> list[dict[str, Any]]:
    """The overlay's objects (``kubectl kustomize``); ``RuntimeError`` without kubectl."""
    import yaml

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise RuntimeError("kubectl is not installed")
    out = subprocess.run(
        [kubectl, "kustomize", str(OVERLAY)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def _model_server(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    (container,) = [
        c
        for c in deployment["spec"]["template"]["spec"]["containers"]
        if c["name"] == "modelserver"
    ]
    return dict(container)


def probe_command() -> list[str]:
    """The model server's probe command (its startup and readiness probes run the same), up
    to the ``&&`` after which it asks vLLM's HTTP API: ``[shell, "-c", "p2pkv probe ..."]``."""
    container = _model_server(render())
    shell, flag, script = container["startupProbe"]["exec"]["command"]
    assert container["readinessProbe"]["exec"]["command"] == [shell, flag, script]
    probe, _, api = script.partition(" && ")
    assert probe.startswith("p2pkv probe ") and "/v1/models" in api, script
    return [shell, flag, probe]


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def engine_settings(port: int, peers: list[int], keys: Path) -> EngineSettings:
    """One engine's settings from the rendered overlay. Replaced, as the cluster would fill
    them in or as the CPU test platform needs: ``status.podIP`` -> 127.0.0.1; the namespace
    -> ``test``; the tier's port (settings.yaml: 7777) -> ``port`` (engines share one host,
    so each needs its own), through ``VLLM_P2P_SIDE_CHANNEL_PORT`` as the overlay sets it;
    the pod CIDR in ``P2PKV_PEERS_ALLOW`` -> 127.0.0.0/8; the headless Service in
    ``P2PKV_PEERS_CONNECT`` -> the engines' addresses ``peers``; the Secret's mount ->
    ``keys``; and the connector's GPU spec and its 88 GiB CPU budget -> the test's CPU spec
    (engine_kit)."""
    container = _model_server(render())
    field_values = {"status.podIP": "127.0.0.1", "metadata.namespace": "test"}
    env: dict[str, str] = {}
    for var in container["env"]:
        value = (
            var["value"]
            if "value" in var
            else field_values[var["valueFrom"]["fieldRef"]["fieldPath"]]
        )
        env[var["name"]] = _REF.sub(lambda m: env.get(m.group(1), m.group(0)), str(value))
    assert env["VLLM_P2P_SIDE_CHANNEL_PORT"] == "7777", env
    env.update(
        P2PKV_PEERS_ALLOW="127.0.0.0/8",
        P2PKV_CURVE_DIR=str(keys),
        P2PKV_PEERS_CONNECT=",".join(f"127.0.0.1:{p}" for p in peers),
        VLLM_P2P_SIDE_CHANNEL_PORT=str(port),
    )
    args = [_REF.sub(lambda m: env.get(m.group(1), m.group(0)), a) for a in container["args"]]
    connector = json.loads(_flag(args, "--kv-transfer-config"))["kv_connector_extra_config"]
    (tier,) = connector.pop("secondary_tiers")
    assert tier == {"type": "p2p", "host": "127.0.0.1", "port": port}, tier
    for platform_key in ("spec_name", "cpu_bytes_to_use"):
        connector.pop(platform_key)
    return tier, connector, _engine_env(env)


def _engine_env(env: Mapping[str, str]) -> dict[str, str]:
    """What an engine process reads of the container's environment (not its shell's)."""
    unused = {"MODEL", "KV_EVENTS_ENDPOINT", "POD_PORT", "POD_IP", "POD_NAMESPACE"}
    return {name: value for name, value in env.items() if name not in unused}
