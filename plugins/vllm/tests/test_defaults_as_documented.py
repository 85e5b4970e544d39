"""What ``p2pkv proxy --help`` and ``p2pkv doctor`` say of ports is what the proxy and the
tier do (issue 45, item 6).

The proxy's help states an instance's default ``p2p_port``; prefillers and decoders both get
it. ``doctor`` reads the tier the way the engine's tier does: the engine entry (upstream keys,
zero-edit mode) and the variables vLLM's tier reads, so the ports it checks are the ports the
tier binds (and ``check-config`` reports).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from p2pkv.cli import main

pytest.importorskip("rich")
pytest.importorskip("p2pkv_tools", reason="needs p2pkv-tools (doctor)")
proxy_config = pytest.importorskip("p2pkv_vllm.proxy.config")

GUIDE = {"type": "p2p", "host": "127.0.0.1", "port": 7777, "num_threads": 4}
"""llm-d's guide entry (its host made loopback) with an upstream key."""


def test_the_proxy_help_states_the_p2p_port_default_both_roles_get(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit):
        main(["proxy", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    stated = proxy_config.INSTANCE_OPTIONS["p2p_port"]
    assert stated in help_text
    assert "$VLLM_P2P_SIDE_CHANNEL_PORT" in stated and "5710" in stated
    for environ, port in (({"VLLM_P2P_SIDE_CHANNEL_PORT": "7777"}, 7777), ({}, 5710)):
        prefiller = proxy_config.parse_prefiller("http://p:8000", environ=environ)
        decoder = proxy_config.parse_decoder("http://d:8000,p2p_host=d", environ=environ)
        assert (prefiller.p2p_port, decoder.p2p_port) == (port, port)


def doctor(*args: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["doctor", "--no-probe", "--json", *args]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


@pytest.mark.parametrize(
    "option, value",
    [
        ("--config", json.dumps(GUIDE)),
        (
            "--kv-transfer-config",
            json.dumps(
                {
                    "kv_connector": "OffloadingConnector",
                    "kv_connector_extra_config": {
                        "spec_name": "TieringOffloadingSpec",
                        "secondary_tiers": [GUIDE],
                    },
                }
            ),
        ),
    ],
)
def test_doctor_checks_the_ports_the_tier_binds(
    option: str, value: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("P2PKV_REPLACE_P2P", "1")
    report = doctor(option, value, "--dp-size", "2", capsys=capsys)
    (where,) = report["listeners"]
    assert (where["host"], where["ports"], where["port_from"]) == (
        "127.0.0.1",
        [7777, 7778],
        "tier key 'port'",
    )
    assert [p["port"] for p in report["ports"]] == [7777, 7778]


def test_doctor_reads_the_variables_vllms_tier_reads(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_P2P_SIDE_CHANNEL_PORT", "7777")
    monkeypatch.setenv("P2PKV_PORT", "6000")
    entry = {"type": "P2PKVTier", "module_path": "p2pkv_vllm", "host": "127.0.0.1"}
    (where,) = doctor("--config", json.dumps(entry), capsys=capsys)["listeners"]
    assert (where["ports"], where["port_from"]) == ([7777], "VLLM_P2P_SIDE_CHANNEL_PORT=7777")
    listeners = doctor(capsys=capsys)["listeners"]
    assert {tuple(w["engines"]): w["ports"] for w in listeners} == {
        ("p2pkv",): [6000],
        ("vLLM",): [7777],
    }


def test_doctor_says_the_builtin_tier_runs_no_p2pkv_and_names_the_fix(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A valid config that runs no p2pkv tier: exit 1, as ``check-config`` (2 is misuse)."""
    monkeypatch.delenv("P2PKV_REPLACE_P2P", raising=False)
    assert main(["doctor", "--no-probe", "--config", json.dumps(GUIDE)]) == 1
    assert capsys.readouterr().err == (
        "p2pkv doctor: secondary_tiers[0] has type 'p2p': vLLM's built-in P2P tier would be "
        "built, not p2pkv's; set P2PKV_REPLACE_P2P=1 on the engines (and here) to build "
        "p2pkv's tier from it unedited\n"
    )


def test_doctor_leaves_the_pods_address_to_the_pod(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guide's entry as written (``$(POD_IP)``, expanded by the kubelet): no port is
    called taken; the line says where to check instead."""
    monkeypatch.setenv("P2PKV_REPLACE_P2P", "1")
    report = doctor("--config", json.dumps({**GUIDE, "host": "$(POD_IP)"}), capsys=capsys)
    assert report["ports"] == [
        {
            "host": "$(POD_IP)",
            "port": 7777,
            "free": None,
            "engines": ["vLLM (type 'p2p' with P2PKV_REPLACE_P2P=1: zero-edit mode)"],
            "change": "the tier key 'port'",
            "detail": "not checked: the kubelet expands $(POD_IP) on the pod; run doctor there, "
            "or check the entry here with `p2pkv check-config --pod-ip IP --no-bind`",
        }
    ]
    capsys.readouterr()
    assert (
        main(["doctor", "--no-probe", "--config", json.dumps({**GUIDE, "host": "$(POD_IP)"})]) == 0
    )
    assert "port $(POD_IP):7777: not checked: the kubelet expands" in capsys.readouterr().out


def test_doctor_expands_the_pods_variables_as_the_kubelet_does(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the pod, ``$(POD_IP)`` is in the environment: doctor checks the address it names."""
    monkeypatch.setenv("P2PKV_REPLACE_P2P", "1")
    monkeypatch.setenv("POD_IP", "127.0.0.1")
    entry = json.dumps({**GUIDE, "host": "$(POD_IP)"})
    for option, value in (
        ("--config", entry),
        (
            "--kv-transfer-config",
            json.dumps({"kv_connector_extra_config": {"secondary_tiers": [json.loads(entry)]}}),
        ),
    ):
        (where,) = doctor(option, value, capsys=capsys)["listeners"]
        assert (where["host"], where["ports"]) == ("127.0.0.1", [7777])
