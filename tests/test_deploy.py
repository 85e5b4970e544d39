"""The shipped llm-d overlay (``deploy/llm-d``): rendered offline with ``kubectl kustomize``,
every object valid against the Kubernetes schemas (strict: no unknown field), the guide's
tier entry left as the guide writes it, and the environment it adds accepted by
``p2pkv check-config`` as the tier would read it at engine start. Real engines run the same
rendered settings in ``nox -s engine`` (plugins/vllm/tests/test_engine_overlay.py)."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[1]
OVERLAY = ROOT / "deploy" / "llm-d" / "overlay"
KUBERNETES = "1.32"
"""The Kubernetes schema version the objects are validated against (kubectl's here)."""


@pytest.fixture(scope="module")
def objects() -> dict[str, dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run([kubectl, "kustomize", str(OVERLAY)], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    docs = [doc for doc in yaml.safe_load_all(out) if doc]
    return {doc["kind"]: doc for doc in docs}


def container(objects: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (vllm,) = [c for c in objects["Deployment"]["spec"]["template"]["spec"]["containers"]
               if c["name"] == "vllm"]
    return dict(vllm)


def test_every_object_is_valid_against_the_kubernetes_schemas(
    objects: dict[str, dict[str, Any]],
) -> None:
    assert sorted(objects) == ["Deployment", "NetworkPolicy", "Service"]
    for kind, obj in objects.items():
        try:
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{kind}: {exc.message} at {list(exc.path)}") from None


def test_the_guide_s_tier_entry_is_unedited(objects: dict[str, dict[str, Any]]) -> None:
    words = shlex.split(container(objects)["args"][0])
    config = json.loads(words[words.index("--kv-transfer-config") + 1])
    tiers = config["kv_connector_extra_config"]["secondary_tiers"]
    assert tiers == [{"type": "p2p", "host": "$(POD_IP)", "port": 7777}]


def test_the_overlay_adds_keys_peers_and_the_opt_in(objects: dict[str, dict[str, Any]]) -> None:
    vllm = container(objects)
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert env["P2PKV_REPLACE_P2P"] == "1"
    mounts = {m["name"]: m for m in vllm["volumeMounts"]}
    assert mounts["p2pkv-curve"]["mountPath"] == env["P2PKV_CURVE_DIR"]
    assert mounts["p2pkv-curve"]["readOnly"] is True
    volumes = {v["name"]: v for v in objects["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["p2pkv-curve"]["secret"] == {"secretName": "p2pkv-curve", "defaultMode": 0o400}
    service = objects["Service"]
    assert service["spec"]["clusterIP"] == "None"  # headless: one address per pod
    assert env["P2PKV_PEERS_CONNECT"].startswith(f"{service['metadata']['name']}.$(POD_NAMESPACE).")
    names = [e["name"] for e in vllm["env"]]
    assert names.index("POD_NAMESPACE") < names.index("P2PKV_PEERS_CONNECT")  # $(..) order


def test_the_network_policy_admits_the_p2p_ports_only_from_model_servers(
    objects: dict[str, dict[str, Any]],
) -> None:
    policy = objects["NetworkPolicy"]["spec"]
    servers = objects["Deployment"]["spec"]["selector"]["matchLabels"]
    assert policy["podSelector"]["matchLabels"] == servers
    p2p = [rule for rule in policy["ingress"] if rule.get("from")]
    assert len(p2p) == 1 and p2p[0]["from"] == [{"podSelector": {"matchLabels": servers}}]
    ranges = {(p["port"], p.get("endPort")) for p in p2p[0]["ports"]}
    assert (7777, 7784) in ranges and (37000, 37099) in ranges
    env = {e["name"]: e.get("value") for e in container(objects)["env"]}
    assert env["UCX_TCP_PORT_RANGE"] == "37000-37099"
    others = [rule for rule in policy["ingress"] if not rule.get("from")]
    assert all(p["port"] not in range(7777, 7785) for rule in others for p in rule["ports"])


def test_check_config_accepts_what_the_overlay_runs(
    objects: dict[str, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("p2pkv_vllm")
    from p2pkv.cli import main

    vllm = container(objects)
    words = shlex.split(vllm["args"][0])
    pod_ip = "127.0.0.1"  # check-config binds the tier's address: one of this host's
    config = words[words.index("--kv-transfer-config") + 1].replace("$(POD_IP)", pod_ip)
    assert main(["keys", "--fleet", "--dir", str(tmp_path)]) == 0
    for var in vllm["env"]:
        if "value" in var:
            monkeypatch.setenv(var["name"], var["value"].replace("$(POD_NAMESPACE)", "llm-d"))
    monkeypatch.setenv("P2PKV_CURVE_DIR", str(tmp_path))  # where the Secret is mounted
    capsys.readouterr()
    assert main(["check-config", "--kv-transfer-config", config]) == 0, capsys.readouterr()
    assert "p2pkv" in capsys.readouterr().out
