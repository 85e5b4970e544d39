"""``p2pkv check-config`` refuses what cannot work, in one line naming what the operator set,
and checks llm-d's guide entry off the pod (issue 45, item 4).

Each row runs the real command in a subprocess: its exit status (0 would start; 2 the tier
would refuse it, or check-config cannot read it: misuse of the config) and its exact stderr.
Allow-list entries that never match a peer; numbers no setting takes (thousands of digits,
1e300, negative, NaN); unknown keys (the suggestion lists every accepted key, upstream's
included); upstream keys and environment variables named as written; the guide's
``$(POD_IP)`` entry checked off the pod, and an overlay's entry read from a file.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("zmq", reason="needs pyzmq (p2pkv-zmq)")
pytest.importorskip("nixl._api", reason="needs NIXL (scripts/install.sh installs it lean)")

SCRIPT = Path(sys.executable).parent / "p2pkv"
P = "p2pkv check-config: secondary_tiers[0]: "
VALID_KEYS = (
    "type, control, data, host, port, control_options, data_options, timeouts, "
    "limits, flow, peers, fingerprint, hash_seed, module_path, backpressure, "
    "locality, backends, num_threads, unbound_store_timeout_s, idle_wait"
)
OURS = {"type": "P2PKVTier", "module_path": "p2pkv_vllm", "data": "memory"}
GUIDE = {"type": "p2p", "host": "$(POD_IP)", "port": 7777}
"""llm-d's P2P guide's entry, as its Deployment spells it."""


def config(entry: dict[str, Any] | str) -> str:
    text = entry if isinstance(entry, str) else json.dumps(entry)
    return (
        '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", '
        '"kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", '
        f'"secondary_tiers": [{text}]}}}}'
    )


def check(entry: dict[str, Any] | str, *args: str, **env: str) -> tuple[int, str, str]:
    return check_text(config(entry), *args, **env)


def check_nofile(entry: dict[str, Any], nofile: int, *args: str) -> tuple[int, str, str]:
    """:func:`check` with a soft ``ulimit -n`` of ``nofile``."""
    return run_check(config(entry), args, {}, nofile)


def check_text(kv_transfer_config: str, *args: str, **env: str) -> tuple[int, str, str]:
    """``p2pkv check-config --kv-transfer-config TEXT ARGS`` in a clean environment plus
    ``env``, with a soft ``ulimit -n`` of :data:`NOFILE`: (exit status, stdout, stderr)."""
    return run_check(kv_transfer_config, args, env, NOFILE)


def run_check(
    kv_transfer_config: str, args: tuple[str, ...], env: dict[str, str], nofile: int
) -> tuple[int, str, str]:
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("P2PKV_", "VLLM_P2P_", "POD_"))
    }
    base.update({"UCX_NET_DEVICES": "lo", "PYTHONHASHSEED": "0"}, **env)
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "p2pkv.cli"]
    done = subprocess.run(
        [*command, "check-config", "--kv-transfer-config", kv_transfer_config, *args],
        env=base,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        preexec_fn=functools.partial(lower_nofile, nofile),
    )
    return done.returncode, done.stdout, done.stderr


NOFILE = 1024
"""The soft descriptor limit check-config runs with here: the zmq socket cap it derives
(``p2pkv_zmq.socket_cap``) is then libzmq's 1,023 on any machine."""
SOCKETS = ", zmq sockets 1023 (derived from ulimit -n 1024)"
"""How the ok line ends with :data:`NOFILE` and ``max_sockets`` unset."""


def lower_nofile(soft: int) -> None:
    """In the child before exec: the soft ``RLIMIT_NOFILE`` becomes ``soft``."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


REFUSED: list[tuple[dict[str, Any] | str, dict[str, str], str]] = [
    (
        OURS,
        {"P2PKV_PEERS_ALLOW": "*"},
        "P2PKV_PEERS_ALLOW entry '*' would allow nothing, not "
        "everything: leave peers.allow empty (unset) to allow any peer, or give the pods' network "
        "(10.0.0.0/8)",
    ),
    (
        OURS,
        {"P2PKV_PEERS_ALLOW": "10.1.0.0/16,10.0.0.0-10.0.0.255"},
        "P2PKV_PEERS_ALLOW entry "
        "'10.0.0.0-10.0.0.255' is a range, which never matches a peer's address: write it as "
        "10.0.0.0/24",
    ),
    (
        OURS,
        {"P2PKV_PEERS_ALLOW": "10.0.*.*"},
        "P2PKV_PEERS_ALLOW entry '10.0.*.*' is a range, "
        "which never matches a peer's address: write it as 10.0.0.0/16",
    ),
    (
        {**OURS, "peers": {"allow": ["ms-p2p.llm-d.svc.cluster.local"]}},
        {},
        "tier config key "
        "peers.allow[0] = 'ms-p2p.llm-d.svc.cluster.local' is a Kubernetes Service's name, which "
        "never matches: routers name pods by their IP; give the pods' network (the cluster's pod "
        "CIDR, e.g. 10.0.0.0/8)",
    ),
    (
        OURS,
        {
            "P2PKV_PEERS_ALLOW": "10.0.0.0/8,p2pkv-peers",
            "P2PKV_PEERS_CONNECT": "p2pkv-peers.llm-d.svc.cluster.local:7777",
        },
        "P2PKV_PEERS_ALLOW entry 'p2pkv-peers' names the Service peers.connect dials "
        "(p2pkv-peers.llm-d.svc.cluster.local), which never matches: routers name pods by "
        "their IP; give the pods' network (the cluster's pod CIDR, e.g. 10.0.0.0/8)",
    ),
    (
        {
            **OURS,
            "peers": {"allow": ["ms-p2p.llm-d"], "connect": ["ms-p2p.llm-d.svc:7777"]},
        },
        {},
        "tier config key peers.allow[0] = 'ms-p2p.llm-d' names the Service peers.connect "
        "dials (ms-p2p.llm-d.svc), which never matches: routers name pods by their IP; give "
        "the pods' network (the cluster's pod CIDR, e.g. 10.0.0.0/8)",
    ),
    (
        {**OURS, "peers": {"allow": ["10.0.0.1:7777"]}},
        {},
        "tier config key peers.allow[0] = "
        "'10.0.0.1:7777' is neither a network (10.0.0.0/8), an address nor a host name (no port, "
        "no scheme)",
    ),
    (
        OURS,
        {"P2PKV_PEERS_ALLOW": "10.0.0.0/8 10.1.0.0/16"},
        "P2PKV_PEERS_ALLOW entry "
        "'10.0.0.0/8 10.1.0.0/16' holds 2 entries: separate them with commas "
        "(10.0.0.0/8,10.1.0.0/16)",
    ),
    (
        OURS,
        {"P2PKV_PEERS_CONNECT": "ms-p2p.$(POD_NAMESPACE).svc:7777"},
        "P2PKV_PEERS_CONNECT "
        "entry 'ms-p2p.$(POD_NAMESPACE).svc:7777' holds a $(VAR) reference Kubernetes did not "
        "expand: define VAR above this variable in the container's env list (only earlier ones "
        "expand)",
    ),
    (
        OURS,
        {"P2PKV_PEERS_MAX_DIALED": "9" * 5000},
        f"P2PKV_PEERS_MAX_DIALED='{'9' * 76}... "
        "must be an integer in 1..2147483647 (sessions this tier may dial)",
    ),
    (
        OURS,
        {"P2PKV_PEERS_IDLE_TIMEOUT": "1e300"},
        "P2PKV_PEERS_IDLE_TIMEOUT='1e300' must be a "
        "number from 0, at most 86400 (seconds before an unused dialed session closes; 0: never)",
    ),
    (
        {**OURS, "timeouts": {"load": 1e300}},
        {},
        "tier config key 'timeouts.load' must be <= 86400 seconds, got 1e+300",
    ),
    (
        {**OURS, "timeouts": {"load": -1}},
        {},
        "tier config key 'timeouts.load' must be > 0 seconds, got -1",
    ),
    (
        '{"type": "P2PKVTier", "module_path": "p2pkv_vllm", "timeouts": {"load": NaN}}',
        {},
        "tier config key 'timeouts.load' must be a finite number, got nan",
    ),
    (
        {**OURS, "limits": {"max_frame_bytes": 2**40}},
        {},
        "tier config key 'limits.max_frame_bytes' must be <= 2147483647, got 1099511627776",
    ),
    (
        {**OURS, "unbound_store_timeout_s": -5},
        {},
        "key 'unbound_store_timeout_s' must be > 0 seconds, got -5",
    ),
    (
        {**OURS, "num_thread": 4},
        {},
        f"unknown tier config key(s) ['num_thread']; valid keys: "
        f"{VALID_KEYS}; did you mean 'num_threads'?",
    ),
]


@pytest.mark.parametrize("entry, env, message", REFUSED)
def test_what_cannot_work_is_refused_naming_what_was_set(
    entry: dict[str, Any] | str, env: dict[str, str], message: str
) -> None:
    assert check(entry, **env) == (2, "", f"{P}{message}\n")


def test_a_number_of_thousands_of_digits_is_unreadable_input() -> None:
    entry = '{"type": "P2PKVTier", "module_path": "p2pkv_vllm", "port": ' + "9" * 5000 + "}"
    assert check(entry) == (
        2,
        "",
        "p2pkv check-config: --kv-transfer-config holds an integer "
        "of thousands of digits: no setting takes such a number\n",
    )


def test_an_empty_curve_dir_is_refused() -> None:
    status, out, err = check({**OURS, "data": "memory", "host": "127.0.0.1"}, P2PKV_CURVE_DIR="")
    assert (status, out) == (2, "")
    assert err == (
        "p2pkv check-config: secondary_tiers[0]: P2PKV_CURVE_DIR is set but empty: "
        "set it to the directory where the fleet's key Secret is mounted, or unset "
        "it (a tier without keys must say insecure: true)\n"
    )


def test_the_guides_entry_off_the_pod(tmp_path: Path) -> None:
    """The guide's ``$(POD_IP)`` entry, zero-edit mode, the fleet's keys: with --no-bind it
    is checked here, and the lines say what only the pod can check."""
    keys = tmp_path / "keys"
    subprocess.run(
        [sys.executable, "-m", "p2pkv.cli", "keys", "--fleet", "--dir", str(keys)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    pod = ["--env", "P2PKV_REPLACE_P2P=1", "--env", f"P2PKV_CURVE_DIR={keys}"]
    status, out, err = check(GUIDE, *pod, "--pod-ip", "10.1.2.3", "--no-bind")
    assert (status, err) == (0, "")
    assert out == (
        "secondary_tiers[0]: ok: p2pkv's P2PKVTier (type 'p2p' with P2PKV_REPLACE_P2P=1: "
        "zero-edit mode): control zmq, data nixl, host 10.1.2.3, ports 7777..7777 (DP ranks "
        f"0..0), security CURVE (fleet keys from P2PKV_CURVE_DIR={keys}), peers allow=any "
        f"connect=none max_dialed=256 warm=32{SOCKETS}\nsecondary_tiers[0]: not checked here "
        "(--no-bind), "
        "only on the pod: listening on "
        "the tier's address and port; the key files as the pod mounts them; the transports' "
        "libraries as the image has them\n"
    )
    status, out, err = check(GUIDE, *pod)
    assert (status, out) == (2, "")
    assert err == (
        "p2pkv check-config: note: $(POD_IP) is unset here: checked as 192.0.2.1 (set it with "
        "--env POD_IP=VALUE or --pod-ip)\n"
        "p2pkv check-config: secondary_tiers[0]: cannot listen on 192.0.2.1:0: Cannot assign "
        "requested address (addr='tcp://192.0.2.1:*'); check the tier config key 'host' (not "
        "an address of this machine: run check-config on the pod, or add --no-bind to check "
        "everything else here)\n"
    )


def test_the_ok_line_says_security_and_peers_as_the_start_line_will() -> None:
    """Exit 0 alone does not say the fleet's keys are on: the ok line names the security
    and the peer policy in the start line's words, so a guide entry without keys shows
    ``security none`` before any pod starts."""
    status, out, err = check(
        GUIDE,
        "--env",
        "P2PKV_REPLACE_P2P=1",
        "--env",
        "POD_NAMESPACE=llm-d",
        "--env",
        "P2PKV_PEERS_CONNECT=p2pkv-peers.$(POD_NAMESPACE).svc.cluster.local:7777",
        "--env",
        "P2PKV_PEERS_ALLOW=10.0.0.0/8",
        "--pod-ip",
        "10.1.2.3",
        "--no-bind",
    )
    assert status == 0, err
    assert (
        "ports 7777..7777 (DP ranks 0..0), security none (insecure: anyone who reaches the "
        "port may open sessions), peers allow=10.0.0.0/8 "
        f"connect=p2pkv-peers.llm-d.svc.cluster.local:7777 max_dialed=256 warm=32{SOCKETS}\n"
    ) in out
    assert "runs with insecure: true" in err


def test_pod_variables_expand_in_order_as_kubernetes_expands_them() -> None:
    status, out, err = check(
        {"type": "p2p", "host": "$(HOST_OF_POD)", "port": 7777},
        "--env",
        "P2PKV_REPLACE_P2P=1",
        "--env",
        "ADDR=127.0.0.1",
        "--env",
        "HOST_OF_POD=$(ADDR)",
        "--env",
        "P2PKV_PEERS_ALLOW=127.0.0.0/8,$$(literal)",
    )
    assert (status, out) == (2, "")
    assert err == (
        f"{P}P2PKV_PEERS_ALLOW entry '$(literal)' holds a $(VAR) reference "
        "Kubernetes did not expand: define VAR above this variable in the "
        "container's env list (only earlier ones expand)\n"
    )
    assert check(OURS, "--env", "NOT A NAME") == (
        2,
        "",
        "p2pkv check-config: --env 'NOT A NAME': expected NAME=VALUE\n",
    )


def test_an_overlay_s_entry_from_a_file_expands_before_it_is_parsed(tmp_path: Path) -> None:
    """The overlay's port is ``$(VLLM_P2P_SIDE_CHANNEL_PORT)`` outside a JSON string: the
    kubelet expands it before vLLM parses the JSON, and so does check-config, from ``@file``
    as from text. Left unset, the one line names it and the fix (exit 2)."""
    path = tmp_path / "kv-transfer-config.json"
    path.write_text(
        config('{"type": "p2p", "host": "$(POD_IP)", "port": $(VLLM_P2P_SIDE_CHANNEL_PORT)}')
    )
    pod = ("--env", "P2PKV_REPLACE_P2P=1", "--pod-ip", "10.1.2.3", "--no-bind")
    status, out, err = check_text(f"@{path}", *pod, "--env", "VLLM_P2P_SIDE_CHANNEL_PORT=7900")
    assert status == 0, err
    assert "host 10.1.2.3, ports 7900..7900" in out
    status, out, err = check_text(f"@{path}", *pod)
    assert (status, out) == (2, "")
    assert err.startswith("p2pkv check-config: --kv-transfer-config is not valid JSON: ")
    assert err.endswith(
        " ($(VLLM_P2P_SIDE_CHANNEL_PORT) unset here: give the pod's value with --env NAME=VALUE)\n"
    )
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    "peers, env, line",
    [
        (
            {"warm": 1000},
            {},
            "peers.max_dialed 256 + peers.warm 1000 = 1256 dialed sessions of 3 zmq "
            "sockets each, above the 335 the zmq context's cap of 1023 (derived from "
            "ulimit -n 1024) holds: lower peers.max_dialed (P2PKV_PEERS_MAX_DIALED) or "
            "peers.warm (P2PKV_PEERS_WARM) to a sum of at most 335, or raise "
            "control_options.max_sockets or ulimit -n",
        ),
        (
            {},
            {"P2PKV_PEERS_WARM": "400"},
            "peers.max_dialed 256 + peers.warm 400 = 656 dialed sessions",
        ),
        (
            {},
            {"P2PKV_PEERS_MAX_DIALED": "100000"},
            "peers.max_dialed 100000 + peers.warm 32 = 100032 dialed sessions",
        ),
    ],
)
def test_absurd_peer_numbers_are_refused_before_the_sockets_run_out(
    peers: dict[str, int], env: dict[str, str], line: str
) -> None:
    """Numbers that parse but can never be served (the zmq context's 1,023 sockets, 3 per
    dialed session) are refused off the pod, exit 2, one line naming them and the fix."""
    entry = {**GUIDE, "peers": peers} if peers else GUIDE
    args = ("--env", "P2PKV_REPLACE_P2P=1", "--pod-ip", "10.1.2.3", "--no-bind")
    status, out, err = check(entry, *args, **env)
    assert (status, out) == (2, ""), err
    assert err.splitlines()[-1].startswith(f"{P}{line}"), err
    assert check({**GUIDE, "peers": {"warm": 63}}, *args, P2PKV_PEERS_MAX_DIALED="200")[0] == 0
    fits = {"P2PKV_PEERS_WARM": "63", "P2PKV_PEERS_MAX_DIALED": "200"}
    assert check(GUIDE, *args, **fits)[0] == 0
    # 335 sessions fit 1,023 sockets: 3 each after the 16 zmq keeps for itself
    assert check(GUIDE, *args, P2PKV_PEERS_WARM="79")[0] == 0
    status, _, err = check(GUIDE, *args, P2PKV_PEERS_WARM="80")
    assert status == 2 and "= 336 dialed sessions" in err and "at most 335" in err, err


def test_the_socket_cap_follows_ulimit_unless_set() -> None:
    """The cap check-config budgets with is the transport's own: derived from this
    process's ``ulimit -n`` (at least libzmq's 1,023), or ``max_sockets`` as set. The ok
    line or the refusal says which, and from what."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if 0 <= hard < 4096:
        pytest.skip(f"needs a hard descriptor limit of 4096, this one is {hard}")
    args = ("--env", "P2PKV_REPLACE_P2P=1", "--pod-ip", "10.1.2.3", "--no-bind")
    warm = {**GUIDE, "peers": {"warm": 400}}  # 656 dialed sessions: 1,968 sockets
    status, _, err = check(warm, *args)
    assert status == 2 and "the zmq context's cap of 1023 (derived from ulimit -n 1024)" in err
    status, out, err = check_nofile(warm, 4096, *args)
    assert status == 0, err
    assert "warm=400, zmq sockets 2164 (derived from ulimit -n 4096)\n" in out
    capped = {**warm, "control_options": {"max_sockets": 1500}}
    status, _, err = check_nofile(capped, 4096, *args)
    assert status == 2, err
    assert "above the 494 the zmq context's cap of 1500 (set by control_options." in err
    status, out, err = check_nofile({**capped, "peers": {"warm": 200}}, 4096, *args)
    assert status == 0, err
    assert "warm=200, zmq sockets 1500 (set by control_options.max_sockets)\n" in out
