"""The shipped llm-d deployment (``deploy/llm-d``), rendered offline with ``kubectl kustomize``.

Both strategies (``overlay``: all at once, ``side-by-side``) are rendered against guide-shaped
bases: the shipped aggregated stand-in, and a P/D one with a Deployment per role (prefill
without the routing sidecar, decode with it), each with the image spelled with and without
``docker.io/``. Every rendered object is valid against the Kubernetes schemas (strict); none
would roll one Deployment from the built-in tier to p2pkv's pod by pod; the model-server
image is always replaced; every ``$(VAR)`` of a container's environment refers to a variable
defined earlier in it; each setting of ``settings.yaml`` (P2P ports, model, allow-list)
reaches every place that uses it and leaves no old value behind; a guide whose arguments
differ stops the render; and ``p2pkv check-config`` accepts what the overlay runs. Real
engines run the rendered settings in ``nox -s engine`` (plugins/vllm/tests/overlay.py).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "llm-d"
KUBERNETES = "1.32"
"""The Kubernetes schema version the objects are validated against (kubectl's here)."""
STRATEGIES = ("overlay", "side-by-side")
BASES = ("aggregated", "pd")
SPELLINGS = ("docker.io/vllm/vllm-openai:v0.27.1", "vllm/vllm-openai:v0.27.1")
BUILT_IMAGE = "registry.example.com/llm-d/vllm-openai-p2pkv:v0.27.1-p2pkv0.1.0"
POOL = "llm-d.ai/guide"
"""The label the router's InferencePool selects model servers by."""
_REF = re.compile(r"\$\((\w+)\)")

Objects = list[dict[str, Any]]


def kustomize(directory: Path) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    if out.returncode != 0:
        raise RenderFailed(out.stderr)
    return out.stdout


class RenderFailed(Exception):
    """``kubectl kustomize`` refused the directory (its message)."""


def parse(text: str) -> Objects:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def role_copy(deployment: dict[str, Any], role: str) -> dict[str, Any]:
    """The guide's Deployment as the model server of ``role`` (P/D: one Deployment each)."""
    made = copy.deepcopy(deployment)
    made["metadata"]["name"] = role
    for labels in (
        made["metadata"]["labels"],
        made["spec"]["selector"]["matchLabels"],
        made["spec"]["template"]["metadata"]["labels"],
    ):
        labels["llm-d.ai/role"] = role
    if role == "prefill":  # P/D: the routing sidecar runs beside the decoders only
        del made["spec"]["template"]["spec"]["initContainers"]
    return made


def deploy_tree(tmp: Path, base: str = "aggregated", image: str = SPELLINGS[0]) -> Path:
    """A copy of ``deploy/llm-d`` whose guide stand-in has the ``base`` shape and ``image``."""
    tree = tmp / "llm-d"
    shutil.copytree(DEPLOY, tree)
    path = tree / "guide-base" / "deployment.yaml"
    (deployment,) = parse(path.read_text())
    deployment["spec"]["template"]["spec"]["containers"][0]["image"] = image
    docs = (
        [role_copy(deployment, "prefill"), role_copy(deployment, "decode")]
        if base == "pd"
        else [deployment]
    )
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return tree


def deployments(objects: Objects) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == "Deployment"]


def model_server(deployment: dict[str, Any]) -> dict[str, Any]:
    (server,) = [
        c
        for c in deployment["spec"]["template"]["spec"]["containers"]
        if c["name"] == "modelserver"
    ]
    return dict(server)


def env_values(
    container: dict[str, Any], pod_ip: str = "10.1.2.3", namespace: str = "llm-d"
) -> dict[str, str]:
    """The container's environment as the kubelet builds it (field refs filled in)."""
    fields = {"status.podIP": pod_ip, "metadata.namespace": namespace}
    env: dict[str, str] = {}
    for var in container["env"]:
        value = (
            var["value"] if "value" in var else fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        )
        env[var["name"]] = _REF.sub(lambda m: env.get(m.group(1), m.group(0)), str(value))
    return env


def expanded_args(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    return [_REF.sub(lambda m: env.get(m.group(1), m.group(0)), a) for a in container["args"]]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


Render = tuple[str, Objects, Objects]
"""(strategy, its objects, the guide base's objects)."""


@pytest.fixture(scope="module")
def renders(tmp_path_factory: pytest.TempPathFactory) -> list[Render]:
    """Both strategies over every base shape and image spelling, rendered once."""
    out = []
    for base in BASES:
        for image in SPELLINGS:
            tree = deploy_tree(tmp_path_factory.mktemp("tree"), base, image)
            guide = parse(kustomize(tree / "guide-base"))
            out += [(s, parse(kustomize(tree / s)), guide) for s in STRATEGIES]
    return out


def test_every_object_is_valid_against_the_kubernetes_schemas(
    renders: list[Render],
) -> None:
    for strategy, objects, _ in renders:
        assert sorted(o["kind"] for o in objects) == sorted(
            ["NetworkPolicy", "Service"] + ["Deployment"] * len(deployments(objects))
        )
        for obj in objects:
            try:
                kubernetes_validate.validate(obj, KUBERNETES, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(
                    f"{strategy}: {obj['kind']} {obj['metadata']['name']}: "
                    f"{exc.message} at {list(exc.path)}"
                ) from None


def test_no_deployment_rolls_across_tiers(renders: list[Render]) -> None:
    """A Deployment the overlay shares with the guide is replaced whole (Recreate); the
    side-by-side pool creates only new objects, on a pool label of its own."""
    for strategy, objects, base in renders:
        guide = {o["metadata"]["name"] for o in deployments(base)}
        guide_pool = {d["spec"]["template"]["metadata"]["labels"][POOL] for d in deployments(base)}
        assert len(deployments(objects)) == len(guide)
        for deployment in deployments(objects):
            name = deployment["metadata"]["name"]
            pool = deployment["spec"]["template"]["metadata"]["labels"][POOL]
            if strategy == "overlay":
                assert name in guide and pool in guide_pool
                assert deployment["spec"]["strategy"] == {"type": "Recreate"}, name
            else:
                assert name not in guide and pool not in guide_pool, name
        if strategy == "side-by-side":
            ours = {(o["kind"], o["metadata"]["name"]) for o in objects}
            assert not ours & {(o["kind"], o["metadata"]["name"]) for o in base}


def test_the_model_server_image_is_replaced_whatever_its_spelling(
    renders: list[Render],
) -> None:
    for strategy, objects, base in renders:
        for deployment, guide in zip(deployments(objects), deployments(base), strict=True):
            pod = deployment["spec"]["template"]["spec"]
            guide_pod = guide["spec"]["template"]["spec"]
            for key in ("containers", "initContainers"):  # the patch added no container
                assert [c["name"] for c in pod.get(key, [])] == [
                    c["name"] for c in guide_pod.get(key, [])
                ], (strategy, key)
            assert model_server(deployment)["image"] == BUILT_IMAGE
            images = [c["image"] for c in pod["containers"] + pod.get("initContainers", [])]
            assert not [i for i in images if "vllm-openai:" in i or "p2pkv-model-server" in i]


def test_every_env_reference_is_defined_earlier_in_the_container(
    renders: list[Render],
) -> None:
    for strategy, objects, _ in renders:
        for deployment in deployments(objects):
            pod = deployment["spec"]["template"]["spec"]
            for container in pod["containers"] + pod.get("initContainers", []):
                defined: list[str] = []
                for var in container.get("env", []):
                    for ref in _REF.findall(var.get("value", "")):
                        assert ref in defined, f"{strategy}: {var['name']} uses $({ref}) first"
                    defined.append(var["name"])
                for word in container.get("command", []) + container.get("args", []):
                    assert set(_REF.findall(word)) <= set(defined), (strategy, word)


def test_the_tier_entry_is_the_guide_s_on_the_configured_port(
    renders: list[Render],
) -> None:
    ports = {"overlay": 7777, "side-by-side": 7800}
    for strategy, objects, _ in renders:
        for deployment in deployments(objects):
            server = model_server(deployment)
            env = env_values(server)
            args = expanded_args(server, env)
            config = json.loads(flag(args, "--kv-transfer-config"))
            tiers = config["kv_connector_extra_config"]["secondary_tiers"]
            assert tiers == [{"type": "p2p", "host": "10.1.2.3", "port": ports[strategy]}]
            assert env["VLLM_P2P_SIDE_CHANNEL_PORT"] == str(ports[strategy])  # what probe reads
            assert env["P2PKV_REPLACE_P2P"] == "1"


def test_pods_prove_their_tier_with_the_fleet_s_keys(renders: list[Render]) -> None:
    for _, objects, _ in renders:
        for deployment in deployments(objects):
            server = model_server(deployment)
            for probe in ("startupProbe", "readinessProbe"):
                command = server[probe]["exec"]["command"]
                assert "httpGet" not in server[probe]
                assert command[:2] == ["/bin/sh", "-c"] and command[2].startswith("p2pkv probe ")
                assert "/v1/models" in command[2]  # and vLLM's API serves, as the guide's probe
            env = env_values(server)
            mounts = {m["name"]: m for m in server["volumeMounts"]}
            assert mounts["p2pkv-curve"] == {
                "name": "p2pkv-curve",
                "readOnly": True,
                "mountPath": env["P2PKV_CURVE_DIR"],
            }
            volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
            assert volumes["p2pkv-curve"]["secret"] == {
                "secretName": "p2pkv-curve",
                "defaultMode": 0o440,
            }


INTERPRETER_STARTS = 5.0
"""Seconds a probe's ``timeoutSeconds`` keeps for starting its two Python processes on a busy
node (p2pkv's and the API check's), beyond the timeouts they are given."""


def test_each_probe_ends_within_its_timeout_seconds(renders: list[Render]) -> None:
    """``p2pkv probe --timeout T`` ends within T (every rank at once: docs/cli.md); the API
    check after it within its own ``timeout=``: together they fit the kubelet's bound."""
    from p2pkv_zmq.probe_cli import DEFAULT_TIMEOUT

    for _, objects, _ in renders:
        for deployment in deployments(objects):
            server = model_server(deployment)
            for probe in ("startupProbe", "readinessProbe"):
                script = server[probe]["exec"]["command"][2]
                ours, _, api = script.partition(" && ")
                args = shlex.split(ours)
                timeout = float(flag(args, "--timeout")) if "--timeout" in args else DEFAULT_TIMEOUT
                (api_timeout,) = map(float, re.findall(r"timeout=([0-9.]+)", api))
                budget = timeout + api_timeout + INTERPRETER_STARTS
                assert budget <= server[probe]["timeoutSeconds"], (probe, script)


def test_peers_service_and_network_policy_cover_exactly_the_pool(
    renders: list[Render],
) -> None:
    for strategy, objects, _ in renders:
        (service,) = [o for o in objects if o["kind"] == "Service"]
        (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
        pools = {d["spec"]["template"]["metadata"]["labels"][POOL] for d in deployments(objects)}
        (pool,) = pools
        assert service["spec"]["clusterIP"] == "None"  # headless: one address per pod
        assert service["spec"]["selector"] == {POOL: pool}
        spec = policy["spec"]
        assert spec["podSelector"]["matchLabels"] == {POOL: pool}
        p2p = [rule for rule in spec["ingress"] if rule.get("from")]
        assert len(p2p) == 1 and p2p[0]["from"] == [{"podSelector": {"matchLabels": {POOL: pool}}}]
        base = service["spec"]["ports"][0]["port"]
        assert {(p["port"], p["endPort"]) for p in p2p[0]["ports"]} == {
            (base, base + 7),
            (37000, 37099),
        }
        others = [
            p["port"] for rule in spec["ingress"] if not rule.get("from") for p in rule["ports"]
        ]
        assert not [p for p in others if base <= p <= base + 7 or 37000 <= p <= 37099], strategy
        for deployment in deployments(objects):
            env = env_values(model_server(deployment))
            assert env["UCX_TCP_PORT_RANGE"] == "37000-37099"
            assert (
                env["P2PKV_PEERS_CONNECT"]
                == f"{service['metadata']['name']}.llm-d.svc.cluster.local:{base}"
            )


SETTINGS = {"p2pPorts": "9100-9103", "model": "Qwen/Qwen3-0.6B", "peersAllow": "10.42.0.0/16"}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("base", BASES)
def test_one_edit_of_settings_reaches_every_place(strategy: str, base: str, tmp_path: Path) -> None:
    tree = deploy_tree(tmp_path, base)
    path = tree / strategy / "settings.yaml"
    (settings,) = parse(path.read_text())
    old = dict(settings["data"])
    settings["data"] = SETTINGS
    path.write_text(yaml.safe_dump(settings))
    text = kustomize(tree / strategy)
    for value in (old["p2pPorts"].split("-")[0], old["model"], "SETTING"):
        assert value not in text, f"{value!r} left in the render"
    objects = parse(text)
    (service,) = [o for o in objects if o["kind"] == "Service"]
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(9100, 9100)]
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
    p2p_ports = policy["spec"]["ingress"][0]["ports"]
    assert {"port": 9100, "endPort": 9103, "protocol": "TCP"} in p2p_ports
    for deployment in deployments(objects):
        server = model_server(deployment)
        env = env_values(server)
        args = expanded_args(server, env)
        tier = json.loads(flag(args, "--kv-transfer-config"))["kv_connector_extra_config"]
        assert tier["secondary_tiers"][0]["port"] == 9100
        assert args[0] == "Qwen/Qwen3-0.6B"
        assert json.loads(flag(args, "--kv-events-config"))["topic"].endswith("@Qwen/Qwen3-0.6B")
        assert env["P2PKV_PEERS_ALLOW"] == "10.42.0.0/16"
        assert env["P2PKV_PEERS_CONNECT"].endswith(":9100")
        assert {"name": "p2p", "containerPort": 9100} in server["ports"]
        for sidecar in deployment["spec"]["template"]["spec"].get("initContainers", []):
            assert "--p2p-connector-port=9100" in sidecar["args"]


def test_a_guide_whose_arguments_differ_stops_the_render(tmp_path: Path) -> None:
    tree = deploy_tree(tmp_path)
    path = tree / "guide-base" / "deployment.yaml"
    path.write_text(
        path.read_text().replace('"offload_prompt_only":false', '"offload_prompt_only":true')
    )
    for strategy in STRATEGIES:
        with pytest.raises(
            RenderFailed,
            match=r"testing value /spec/template/spec/containers/0"
            r"/args/4 failed",
        ):
            kustomize(tree / strategy)


def test_the_way_back_recreates_the_guide_s_deployment(tmp_path: Path) -> None:
    tree = deploy_tree(tmp_path, "pd")
    guide = deployments(parse(kustomize(tree / "guide-base")))
    back = deployments(parse(kustomize(tree / "builtin")))
    for deployment, original in zip(back, guide, strict=True):
        assert deployment["spec"].pop("strategy") == {"type": "Recreate"}
        assert deployment == original


def test_check_config_accepts_what_the_overlay_runs(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("p2pkv_vllm")
    from p2pkv.cli import main

    (deployment,) = deployments(parse(kustomize(DEPLOY / "overlay")))
    server = model_server(deployment)
    env = env_values(server, pod_ip="127.0.0.1")  # check-config binds the tier's address
    config = flag(expanded_args(server, env), "--kv-transfer-config")
    assert main(["keys", "--fleet", "--dir", str(tmp_path)]) == 0
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("P2PKV_CURVE_DIR", str(tmp_path))  # where the Secret is mounted
    capsys.readouterr()
    assert main(["check-config", "--kv-transfer-config", config]) == 0, capsys.readouterr()
    assert "p2pkv" in capsys.readouterr().out


def test_the_guide_s_shell_command_is_kept() -> None:
    (deployment,) = deployments(parse(kustomize(DEPLOY / "overlay")))
    command = model_server(deployment)["command"]
    assert command[:2] == ["sh", "-c"] and shlex.split(command[2])[-3:] == ["vllm", "serve", "$@"]


def test_the_build_context_holds_only_what_the_containerfile_copies() -> None:
    """``.containerignore`` (and ``.dockerignore``, the same file) excludes everything but
    the Containerfile's COPY sources: no .venv, .nox, caches or site/ in the context."""
    ignore = ROOT / ".containerignore"
    assert (ROOT / ".dockerignore").resolve() == ignore.resolve()
    patterns = [
        line for line in ignore.read_text().splitlines() if line and not line.startswith("#")
    ]
    assert patterns[0] == "*"
    copied = [
        line.split()[1]
        for line in (DEPLOY / "Containerfile").read_text().splitlines()
        if line.startswith("COPY ")
    ]
    assert sorted(p[1:] for p in patterns if p.startswith("!")) == sorted(copied)


def _fenced_blocks(path: Path) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S)


def test_the_readme_s_check_of_the_rendered_entry_passes(tmp_path: Path) -> None:
    """deploy/llm-d/README.md's commands that check the overlay's rendered entry off the pod,
    run as written from a directory holding ``deploy/``: the entry's unquoted
    ``$(VLLM_P2P_SIDE_CHANNEL_PORT)`` expands and the tier would start (exit 0)."""
    pytest.importorskip("p2pkv_vllm")
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    (block,) = [
        b
        for b in _fenced_blocks(DEPLOY / "README.md")
        if "check-config --kv-transfer-config @kv-transfer-config.json" in b
    ]
    (tmp_path / "deploy").symlink_to(ROOT / "deploy")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("P2PKV_", "VLLM_P2P_"))}
    env["PATH"] = os.pathsep.join(
        [str(Path(sys.executable).parent), str(Path(kubectl).parent), env.get("PATH", "")]
    )
    env["NS"] = "llm-d"
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "ok: p2pkv's P2PKVTier (type 'p2p' with P2PKV_REPLACE_P2P=1" in done.stdout
    assert "ports 7777..7777" in done.stdout
    assert (
        "security CURVE (fleet keys from P2PKV_CURVE_DIR=./keys), peers allow=10.0.0.0/8 "
        "connect=p2pkv-peers.llm-d.svc.cluster.local:7777 max_dialed=256 warm=32"
    ) in done.stdout


def test_no_doc_pipes_fresh_keys_into_kubectl_apply() -> None:
    """``p2pkv keys --secret`` writes fresh keys: applied over an existing Secret they would
    replace the fleet's keys without a word. Every doc creates the Secret instead."""
    docs = [ROOT / "README.md", DEPLOY / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for path in docs:
        for line in path.read_text().splitlines():
            if "p2pkv keys --secret" in line and "|" in line:
                assert "kubectl create" in line, f"{path.name}: {line}"


def test_the_strategies_share_no_object(tmp_path: Path) -> None:
    """``side-by-side/`` creates only objects of its own: applied beside a fleet switched
    with ``overlay/`` (a new model, new server keys), it changes none of that fleet's
    objects, and deleting it deletes none of them."""
    tree = deploy_tree(tmp_path, "pd")
    named = {
        s: {(o["kind"], o["metadata"]["name"]) for o in parse(kustomize(tree / s))}
        for s in (*STRATEGIES, "guide-base")
    }
    assert not named["side-by-side"] & (named["overlay"] | named["guide-base"])
    (deployment, *_) = deployments(parse(kustomize(tree / "side-by-side")))
    (service,) = [name for kind, name in named["side-by-side"] if kind == "Service"]
    connect = env_values(model_server(deployment))["P2PKV_PEERS_CONNECT"]
    assert connect.startswith(f"{service}.llm-d.svc.cluster.local:")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_dp8_pool_pre_connects_every_rank_as_the_readme_says(
    strategy: str, tmp_path: Path
) -> None:
    """deploy/llm-d/README.md, "Size pre-connect": DP8 lists every rank's port in
    ``P2PKV_PEERS_CONNECT``. The edit renders in both strategies (side by side: its own
    Service), expands to eight entries, and check-config accepts it for eight ranks."""
    pytest.importorskip("p2pkv_vllm")
    tree = deploy_tree(tmp_path)
    path = tree / "p2pkv" / "model-server.yaml"
    base = 7800 if strategy == "side-by-side" else 7777  # settings.yaml's p2pPorts
    ranks = ",".join(f"$(PEERS_SERVICE):{port}" for port in range(base + 1, base + 8))
    text = path.read_text()
    old = "value: $(PEERS_SERVICE):$(VLLM_P2P_SIDE_CHANNEL_PORT)"
    assert old in text
    path.write_text(text.replace(old, f"{old},{ranks}"))
    (deployment,) = deployments(parse(kustomize(tree / strategy)))
    env = env_values(model_server(deployment))
    service = env["PEERS_SERVICE"]
    assert service.startswith("p2pkv-peers" + ("-p2pkv." if strategy == "side-by-side" else "."))
    assert env["P2PKV_PEERS_CONNECT"].split(",") == [
        f"{service}:{port}" for port in range(base, base + 8)
    ]
    args = expanded_args(model_server(deployment), env)
    cli = [sys.executable, "-m", "p2pkv.cli"]
    subprocess.run([*cli, "keys", "--fleet", "--dir", str(tmp_path / "keys")], check=True)
    env["P2PKV_CURVE_DIR"] = str(tmp_path / "keys")  # where the Secret is mounted
    config = flag(args, "--kv-transfer-config")
    done = subprocess.run(
        [
            *cli,
            "check-config",
            "--kv-transfer-config",
            config,
            "--data-parallel-size=8",
            "--no-bind",
        ],
        env={**os.environ, **env, "UCX_NET_DEVICES": "lo"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert f"ports {base}..{base + 7} (DP ranks 0..7)" in done.stdout
    assert f"connect={env['P2PKV_PEERS_CONNECT']} " in done.stdout
