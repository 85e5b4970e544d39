"""``p2pkv doctor``: what an operator needs when something is slow or fails.

Sections: versions; installed transports and why others are unavailable (the ``p2pkv
plugins`` report); where a tier would listen, per engine (standalone p2pkv reads
``P2PKV_HOST``/``P2PKV_PORT``; under vLLM, when ``p2pkv-vllm`` is installed, its
``VLLM_P2P_SIDE_CHANNEL_HOST``/``_PORT`` come first), whether those ports are free, and
whether ``PYTHONHASHSEED`` is set (vLLM's block hashes depend on it across instances; its
value is never shown); which UCX lanes each UCX-based data transport picks on this host; the
environment variables that change lanes and ports; how NIXL is installed; and the checks plugins
add (hook ``p2pkv_doctor_checks``), each printed ok or FAILED under its plugin's name.

Lanes are read from UCX itself: a subprocess with ``UCX_PROTO_INFO=y`` builds two endpoints of
the transport in one process, one reads a 1 MiB block from the other (and checks its bytes),
and UCX prints the protocol it selected per operation and size range; we parse those tables. Two
endpoints in one process talk through UCX's intra-node path, the one two serving processes on
one host use as well. A transport whose descriptor reports it does not use UCX shows nothing.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Any

from p2pkv import __version__
from p2pkv.check_config import data_parallel_size
from p2pkv.cli import TOOL_COMMANDS, make_console, print_error, print_json
from p2pkv.cli_plugins import plugin_report, print_report
from p2pkv.config import HOST_ENV, PORT_ENV, TierConfig
from p2pkv.errors import ConfigError
from p2pkv.hookspecs import CheckResult, DoctorCheck
from p2pkv.json_option import json_object, option_text
from p2pkv.registry import Registry, default_registry
from p2pkv.ucx_proto import LaneRow, parse_proto_info
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from p2pkv_tools.bench.hostinfo import RELEVANT_ENV, describe_host, environ_restored

__all__ = [
    "LaneRow",
    "add_parser",
    "check_ports",
    "listeners",
    "nixl_install_note",
    "parse_proto_info",
    "plugin_checks",
    "probe_lanes",
    "run",
    "summarize_lanes",
    "transport_lanes",
]

UCX_TRANSPORTS = ("nixl", "ucx")
"""Data transports built on UCX, whose lanes are worth probing."""
_PROBE_TIMEOUT = 45.0
_PROBE_BLOCK = 1024 * 1024


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help=TOOL_COMMANDS["doctor"],
        description="Everything needed when p2pkv is slow or fails on this host.",
    )
    given = p.add_mutually_exclusive_group()
    given.add_argument(
        "--config",
        metavar="JSON",
        help="tier config or vLLM secondary_tiers entry (JSON text or @file) "
        "whose ports to check, read as the tier reads it",
    )
    given.add_argument(
        "--kv-transfer-config",
        metavar="JSON",
        help="vLLM's --kv-transfer-config (JSON text or @file): the ports of "
        "its p2pkv entries, as the engine's tier reads them",
    )
    p.add_argument(
        "--dp-size",
        "--data-parallel-size",
        dest="dp_size",
        type=data_parallel_size,
        default=1,
        metavar="N",
        help="data-parallel ranks on this host (the engine's "
        "--data-parallel-size): check base port .. base+N-1",
    )
    p.add_argument(
        "--no-probe",
        action="store_true",
        help="skip the UCX lane probe (it starts a subprocess for a few seconds)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


# -- UCX lanes ------------------------------------------------------------------------------


def _probe_read(src: Any, dst: Any, timeout: float) -> None:
    """``dst`` reads ``src``'s block 0 into its block 1, both sides progressed (a two-sided
    transport serves the read from the source's ``progress``/``poll``) until it is reported
    done; raises if it fails or is not done within ``timeout`` seconds."""
    import time

    tid = dst.read_blocks("src", [1], [0])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        src.progress()
        src.poll("dst")
        dst.progress()
        done, failed = dst.poll("src")
        if tid in failed:
            raise RuntimeError("probe read failed")
        if tid in done:
            return
    raise TimeoutError(f"probe read did not finish in {timeout:.0f} s")


def _probe_child(name: str) -> None:
    """Subprocess body: two endpoints of data transport ``name`` in this process, one 1 MiB
    block read by one from the other and compared byte for byte. Prints ``PROBE-OK`` or
    ``PROBE-FAIL <why>``."""
    import numpy as np
    from p2pkv.contracts import DataSettings

    try:
        cls = default_registry().transport("data", name)
        bufs = [np.zeros(_PROBE_BLOCK * 2, np.uint8) for _ in range(2)]
        bufs[0][:_PROBE_BLOCK] = np.arange(_PROBE_BLOCK) % 251 + 1  # no zero byte
        src, dst = (cls.create(DataSettings(b.data, _PROBE_BLOCK, {})) for b in bufs)
        src.add_peer("dst", dst.descriptor())
        dst.add_peer("src", src.descriptor())
        _probe_read(src, dst, 20.0)
        if not np.array_equal(bufs[1][_PROBE_BLOCK:], bufs[0][:_PROBE_BLOCK]):
            raise RuntimeError("probe read reported done but the block's bytes differ")
        dst.close()
        src.close()
    except Exception as exc:
        print(f"PROBE-FAIL {type(exc).__name__}: {exc}", flush=True)
        return
    print("PROBE-OK", flush=True)


_LANE_HELPERS = {"nixl": ("p2pkv_nixl.ucx", "ucx_lanes")}
"""Lane probes a transport distribution ships itself (preferred over the generic probe)."""


def transport_lanes(name: str) -> dict[str, Any]:
    """The lanes data transport ``name`` picks: its own helper if it ships one, else the
    generic probe (:func:`probe_lanes`). ``{"ok", "error", "lanes", "source"}``."""
    module_name, func_name = _LANE_HELPERS.get(name, ("", ""))
    helper = None
    if module_name:
        try:
            helper = getattr(importlib.import_module(module_name), func_name)
        except (ImportError, AttributeError):
            helper = None
    if helper is None:
        return {**probe_lanes(name), "source": "p2pkv doctor probe"}
    report = helper()
    rows = [
        LaneRow(t["context"], t["operation"], r["range"], r["protocol"], r["lane"])
        for t in report.get("tables", [])
        if t.get("scope") != "self"
        for r in t["rows"]
    ]
    return {
        "ok": bool(report.get("ok")),
        "error": str(report.get("error", "")),
        "lanes": summarize_lanes(rows),
        "source": f"{module_name}.{func_name}",
    }


def probe_lanes(name: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run the lane probe for data transport ``name`` in a subprocess (bounded)."""
    env = dict(os.environ if environ is None else environ)
    env["UCX_PROTO_INFO"] = "y"
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    code = f"from p2pkv_tools.doctor import _probe_child; _probe_child({name!r})"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=_PROBE_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"probe timed out after {_PROBE_TIMEOUT:.0f}s", "lanes": []}
    out = proc.stdout + proc.stderr
    ok = "PROBE-OK" in proc.stdout
    error = ""
    if not ok:
        fail = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE-FAIL")]
        error = fail[0][len("PROBE-FAIL ") :] if fail else f"probe exited {proc.returncode}"
    return {"ok": ok, "error": error, "lanes": summarize_lanes(parse_proto_info(out))}


_FAMILIES = (
    ("remote memory write", "RMA write (data)"),
    ("remote memory read", "RMA read (data)"),
    ("tagged message", "tagged send (data)"),
    ("stream", "stream (data)"),
    ("active message", "active messages (notifications)"),
)


def summarize_lanes(rows: Sequence[LaneRow]) -> list[dict[str, str]]:
    """Rows per operation family: data operations per size range (the plain call's table,
    not its ``(fast-completion)``/``(multi)`` variants), active messages merged."""
    out: dict[tuple[str, str], dict[str, str]] = {}
    for r in rows:
        family = next((f for key, f in _FAMILIES if key in r.operation), r.operation)
        if "*(" in r.operation and not family.startswith("active messages"):
            continue
        if family.startswith("active messages"):
            entry = out.setdefault(
                (family, ""),
                {"operation": family, "size_range": "all", "protocol": "", "lanes": ""},
            )
            for field, value in (("protocol", r.protocol), ("lanes", r.lanes)):
                have = [v for v in entry[field].split(", ") if v]
                if value not in have:
                    entry[field] = ", ".join([*have, value])
        else:
            out.setdefault(
                (family, r.size_range),
                {
                    "operation": family,
                    "size_range": r.size_range,
                    "protocol": r.protocol,
                    "lanes": r.lanes,
                },
            )
    return list(out.values())


# -- ports ----------------------------------------------------------------------------------


def check_ports(host: str, ports: Sequence[int]) -> list[dict[str, Any]]:
    """Whether each ``host:port`` can be bound now (as the ZMQ listener would bind it).

    Uses ``SO_REUSEADDR`` like libzmq, so a port in TIME_WAIT counts as free. Port 0 is
    ephemeral and always free. A host holding a ``$(VAR)`` reference (llm-d's ``$(POD_IP)``,
    which the kubelet expands on the pod) is not checked: ``free`` is None."""
    if "$(" in host:
        later = (
            f"not checked: the kubelet expands {host} on the pod; run doctor there, or "
            "check the entry here with `p2pkv check-config --pod-ip IP --no-bind`"
        )
        return [{"host": host, "port": p, "free": None, "detail": later} for p in ports]
    results = []
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        addrs = sorted({(info[0], info[4][0]) for info in infos})
    except socket.gaierror as exc:
        return [
            {"host": host, "port": p, "free": False, "detail": f"cannot resolve: {exc}"}
            for p in ports
        ]
    for port in ports:
        problems = []
        for family, addr in addrs:
            if port == 0:
                continue
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((addr, port))
                except OSError as exc:
                    why = "in use" if exc.errno == errno.EADDRINUSE else exc.strerror
                    problems.append(f"{addr}: {why}{_owner(port)}")
        results.append(
            {"host": host, "port": port, "free": not problems, "detail": "; ".join(problems)}
        )
    return results


def _owner(port: int) -> str:
    try:
        import psutil
    except ImportError:
        return ""
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
                if conn.pid is None:
                    return " (by another user's process)"
                return f" (by pid {conn.pid} {psutil.Process(conn.pid).name()})"
    except (psutil.Error, OSError):
        pass
    return ""


# -- plugins' checks -----------------------------------------------------------------------


def plugin_checks(registry: Registry) -> list[dict[str, Any]]:
    """Run every plugin's checks (hook ``p2pkv_doctor_checks``): one row ``{"plugin",
    "check", "ok", "detail"}`` per check. A hook or check that raises, or returns something
    else, is a failed row naming the plugin. Never raises."""
    rows = []
    for plugin, outcome in registry.doctor_checks():
        if isinstance(outcome, Exception):
            rows.append(
                _check_row(
                    plugin,
                    "p2pkv_doctor_checks",
                    CheckResult(False, f"the hook raised {type(outcome).__name__}: {outcome}"),
                )
            )
        else:
            rows.extend(
                _check_row(plugin, getattr(c, "name", repr(c)), _run_check(c)) for c in outcome
            )
    return rows


def _run_check(check: object) -> CheckResult:
    if not isinstance(check, DoctorCheck):
        return CheckResult(False, f"{check!r} is not a p2pkv.hookspecs.DoctorCheck")
    try:
        result = check.run()
    except Exception as exc:  # a plugin's bug is its check failing, not the doctor's
        return CheckResult(False, f"the check raised {type(exc).__name__}: {exc}")
    if not isinstance(result, CheckResult):
        return CheckResult(False, f"the check returned {result!r}, not a CheckResult")
    return result


def _check_row(plugin: str, check: str, result: CheckResult) -> dict[str, Any]:
    return {"plugin": plugin, "check": check, "ok": result.ok, "detail": result.detail}


# -- NIXL install ---------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def nixl_install_note() -> str:
    """How NIXL is installed here, and what that means (lean install explained)."""
    cu12, cu13, meta, torch = (_version(d) for d in ("nixl-cu12", "nixl-cu13", "nixl", "torch"))
    how = (
        "Install it lean (no torch/CUDA): pip install numpy && pip install --no-deps "
        "nixl-cu12==1.5.1 nixl==1.5.1 (scripts/install.sh does this). Plain "
        "`pip install nixl` pulls torch and the CUDA stack (about 6 GB) because nixl-cu12 "
        "declares torch although it never imports it, and it silently resolves 1.5.1 because "
        "nixl 1.5.2's wheels are missing."
    )
    if cu12 is None and cu13 is None:
        return "NIXL is not installed, so the nixl data transport is unavailable. " + how
    wheel = f"nixl-cu12 {cu12}" if cu12 else f"nixl-cu13 {cu13}"
    if torch is None:
        return (
            f"NIXL is installed lean: {wheel}{f' + nixl {meta}' if meta else ''} without torch "
            "or CUDA. NIXL's UCX backend runs on host memory with no GPU. `pip check` reports "
            "'nixl-cu12 requires torch' (and 'nixl requires nixl-cu13'): harmless, torch is "
            "declared but never imported."
        )
    return (
        f"NIXL is installed with torch {torch} ({wheel}). That works; a CPU-only host does not "
        "need torch for p2pkv. " + how
    )


# -- the command ----------------------------------------------------------------------------


def _entry_config(args: argparse.Namespace) -> tuple[Any, Mapping[str, Any]] | None:
    """The engine entry ``--config`` or ``--kv-transfer-config`` names, as ``(check_config.Entry,
    connector extra config)``, or None for a plain tier config (or none given). An entry is
    read by its engine adapter, as at engine start (its environment variables, upstream keys,
    zero-edit mode; ``$(NAME)`` references expanded from this environment as the kubelet
    expands them, those unset left as written). ``ConfigError`` names the option when it
    cannot be read."""
    from p2pkv import check_config

    def read(text: str, option: str, what: str) -> dict[str, Any]:
        expanded = check_config.expand(
            option_text(text, option), os.environ, set(), placeholder=False
        )
        return json_object(expanded, option, what)

    if args.kv_transfer_config:
        kv = read(args.kv_transfer_config, "--kv-transfer-config", "vLLM's KVTransferConfig")
    elif args.config:
        raw = read(args.config, "--config", "a tier config, or a vLLM secondary_tiers entry")
        if "module_path" not in raw and "type" not in raw:
            return None
        kv = {"kv_connector_extra_config": {"secondary_tiers": [raw]}}
    else:
        return None
    extra, found = check_config.entries(kv)  # BuiltInTier: see ``run``
    return found[0], extra


def _config_dict(text: str | None) -> dict[str, Any]:
    """A plain ``--config`` tier config (JSON text, or ``@file`` holding it)."""
    return {} if not text else json_object(text, "--config", "a tier config")


_ENGINE_ENV = {"vLLM": "p2pkv_vllm.bridge"}
"""Engine adapters installed here whose module names the host/port variables they read first
(``HOST_ENV``, ``PORT_ENV``): vLLM's ``VLLM_P2P_SIDE_CHANNEL_*`` beat ``P2PKV_*``."""


def _engines() -> list[tuple[str, Sequence[str], Sequence[str]]]:
    """(who, host variables, port variables) for each way a tier may start on this host."""
    engines: list[tuple[str, Sequence[str], Sequence[str]]] = [("p2pkv", HOST_ENV, PORT_ENV)]
    for engine, module_name in _ENGINE_ENV.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        engines.append((engine, module.HOST_ENV, module.PORT_ENV))
    return engines


def _source(raw: Mapping[str, Any], key: str, names: Sequence[str]) -> tuple[str, str]:
    """Which input sets ``key``, and what to change to move it: the --config key, else the
    first variable set (the one ``TierConfig.from_dict`` reads), else the default (changed
    through the first variable)."""
    if key in raw:
        return f"tier key {key!r}", f"the tier key {key!r}"
    name = next((n for n in names if os.environ.get(n)), None)
    if name is None:
        return "default", names[0]
    return f"{name}={os.environ[name]}", name


def entry_listeners(entry: Any, extra: Mapping[str, Any], dp_size: int) -> list[dict[str, Any]]:
    """Where the tier of an engine entry would listen (its adapter's reading of the entry and
    of this environment), as :func:`listeners` reports it."""
    try:
        cfg = entry.adapter.entry_tier_config(entry.keys, extra_config=extra, dp_rank=dp_size - 1)
    except ConfigError as exc:
        ranks = f" (--dp-size {dp_size}: lower the base port or the DP size)"
        raise ConfigError(f"{entry.says(exc)}{ranks if dp_size > 1 else ''}") from None
    raw = entry.keys
    host_env, port_env = entry.adapter.HOST_ENV, entry.adapter.PORT_ENV
    host_from, _ = _source(raw, "host", host_env)
    port_from, port_change = _source(raw, "port", port_env)
    ports = [cfg.base_port + r for r in range(dp_size)] if cfg.base_port else [0]
    return [
        {
            "engines": [f"vLLM ({entry.how})"],
            "host": cfg.host,
            "ports": ports,
            "host_from": host_from,
            "port_from": port_from,
            "port_change": port_change,
            "control": cfg.control,
            "data": cfg.data,
        }
    ]


def listeners(raw: Mapping[str, Any], dp_size: int) -> list[dict[str, Any]]:
    """Where a tier built from ``raw`` would listen, per engine: host, the ports of DP ranks
    0..dp_size-1, which key or variable set each, and what to change to move the port.
    Engines that resolve alike are merged. Raises ``ConfigError`` (naming ``--dp-size`` when
    it matters) for an invalid config or a last rank's port outside 1..65535."""
    found: dict[tuple[Any, ...], dict[str, Any]] = {}
    for engine, host_env, port_env in _engines():
        try:
            cfg = TierConfig.from_dict(
                raw, dp_rank=dp_size - 1, host_env=host_env, port_env=port_env
            )
        except ConfigError as exc:
            ranks = f" (--dp-size {dp_size}: lower the base port or the DP size)"
            raise ConfigError(f"{exc}{ranks if dp_size > 1 else ''}") from None
        ports = tuple(cfg.base_port + r for r in range(dp_size)) if cfg.base_port else (0,)
        host_from, _ = _source(raw, "host", host_env)
        port_from, port_change = _source(raw, "port", port_env)
        entry = found.setdefault(
            (cfg.host, ports, host_from, port_from),
            {
                "engines": [],
                "host": cfg.host,
                "ports": list(ports),
                "host_from": host_from,
                "port_from": port_from,
                "port_change": port_change,
                "control": cfg.control,
                "data": cfg.data,
            },
        )
        entry["engines"].append(engine)
    return list(found.values())


def collect(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``p2pkv doctor`` shows, as plain data; ``ConfigError`` for bad options."""
    registry = default_registry()
    engine_entry = _entry_config(args)
    listen = (
        entry_listeners(*engine_entry, args.dp_size)
        if engine_entry is not None
        else listeners(_config_dict(args.config), args.dp_size)
    )
    lanes: dict[str, Any] = {}
    if not args.no_probe:
        for name in UCX_TRANSPORTS:
            entry = registry.entries("data").get(name)
            with environ_restored():
                usable = entry is not None and entry.cls.availability() is None
            if usable:
                lanes[name] = transport_lanes(name)
    with environ_restored():  # availability() may import libraries that set UCX_* vars
        plugins = plugin_report(registry)
    ports = [
        {**result, "engines": where["engines"], "change": where["port_change"]}
        for where in listen
        for result in check_ports(where["host"], where["ports"])
    ]
    seed = os.environ.get("PYTHONHASHSEED", "")
    return {
        "p2pkv": __version__,
        "host": describe_host(),
        "plugins": plugins,
        "listeners": listen,
        "ports": ports,
        "python_hash_seed": "random" if seed == "random" else "set" if seed else "unset",
        "ucx_lanes": lanes,
        "env_unset": [k for k in RELEVANT_ENV if k not in os.environ],
        "nixl_install": nixl_install_note(),
        "plugin_checks": plugin_checks(registry),
    }


def _lane_table(name: str, probe: Mapping[str, Any]) -> Table:
    table = Table(
        title=f"UCX lanes picked by the {name} transport on this host (from {probe['source']})",
        title_justify="left",
    )
    for col in ("operation", "size (bytes)", "protocol", "lanes"):
        table.add_column(col)
    for row in probe["lanes"]:
        table.add_row(row["operation"], row["size_range"], row["protocol"], row["lanes"])
    return table


def _advice(report: Mapping[str, Any]) -> list[str]:
    tips = []
    env = report["host"]["env"]
    if "UCX_NET_DEVICES" not in env:
        tips.append(
            "UCX_NET_DEVICES is unset: on a single host UCX may stripe TCP over every "
            "interface; set UCX_NET_DEVICES=lo for loopback-only runs."
        )
    if env.get("UCX_TLS") in {"tcp", "self,tcp"}:
        tips.append(
            "UCX_TLS forces TCP: intra-host reads lose the zero-copy cma lane "
            "(about 3x slower here) and nixl stages them (one more copy)."
        )
    for name, probe in report["ucx_lanes"].items():
        tcp_data = [
            r
            for r in probe["lanes"]
            if ("remote memory" in r["operation"] or "tag" in r["operation"])
            and "tcp" in r["lanes"]
            and "inf" in r["size_range"]
        ]
        if tcp_data:
            tips.append(
                f"{name}: large transfers go over TCP ({tcp_data[0]['lanes']}); expect "
                "about 1 GB/s instead of the cma zero-copy lane."
            )
    return tips


def _hints(report: Mapping[str, Any]) -> list[str]:
    """Advice on ports and engines: what to change for a taken port, and PYTHONHASHSEED
    when a vLLM tier may start here (vLLM's block hashes depend on it across instances)."""
    tips = [
        f"{p['host']}:{p['port']} ({', '.join(p['engines'])}) is taken: choose a free base "
        f"port with {p['change']}."
        for p in report["ports"]
        if p["free"] is False
    ]
    vllm = any("vLLM" in where["engines"] for where in report["listeners"])
    if vllm and report["python_hash_seed"] != "set":
        tips.append(
            "PYTHONHASHSEED is " + report["python_hash_seed"] + ": with a "
            "non-cryptographic prefix_caching_hash_algo vLLM then seeds block hashes "
            "per process and no two instances ever match each other's blocks; set "
            "PYTHONHASHSEED to one value on every instance."
        )
    return tips


def _print_listeners(console: Console, report: Mapping[str, Any]) -> None:
    for where in report["listeners"]:
        console.print(
            f"tier ({', '.join(where['engines'])}): control={where['control']} "
            f"data={where['data']} host {where['host']} ({where['host_from']}), "
            f"base port {where['ports'][0]} ({where['port_from']})"
        )
    for p in report["ports"]:
        state = (
            "[green]free[/]"
            if p["free"]
            else escape(p["detail"])
            if p["free"] is None
            else f"[red]NOT free[/]: {escape(p['detail'])}"
        )
        console.print(f"  port {p['host']}:{p['port']}: {state}")
    console.print(f"PYTHONHASHSEED: {report['python_hash_seed']}")


def _print_plugin_checks(console: Console, report: Mapping[str, Any]) -> None:
    for c in report["plugin_checks"]:
        state = "[green]ok[/]" if c["ok"] else "[red]FAILED[/]"
        detail = f": {escape(c['detail'])}" if c["detail"] else ""
        console.print(f"check {escape(c['check'])} ({c['plugin']}): {state}{detail}")


def run(args: argparse.Namespace) -> int:
    """Print (or ``--json``, status 0) the report; 1 when a port a tier would bind is taken
    or a plugin's check failed, or when the entry is vLLM's built-in tier (valid, but no
    p2pkv tier: one line, as ``check-config`` says it), else 0. Bad options raise
    ``ConfigError`` (the CLI prints one line and exits 2)."""
    from p2pkv.check_config import BuiltInTier

    try:
        report = collect(args)
    except BuiltInTier as exc:
        print_error("p2pkv doctor", str(exc))
        return 1
    if args.json:
        print_json(report)
        return 0
    console = make_console()
    host = report["host"]
    console.rule(f"p2pkv {report['p2pkv']} doctor")
    console.print(
        f"host: {host['cpu']}, {host['cores']} cores, {host['memory_gib']} GiB, "
        f"kernel {host['kernel']}, Python {host['python']}"
    )
    console.print("libraries: " + ", ".join(f"{k} {v}" for k, v in host["libraries"].items()))
    print_report(console, report["plugins"])
    _print_listeners(console, report)
    _print_plugin_checks(console, report)
    for name, probe in report["ucx_lanes"].items():
        if probe["lanes"]:
            console.print(_lane_table(name, probe))
        if not probe["ok"]:
            console.print(f"[red]{name} lane probe failed:[/] {escape(probe['error'])}")
    if host["env"]:
        console.print("environment: " + ", ".join(f"{k}={v}" for k, v in host["env"].items()))
    console.print("unset: " + ", ".join(report["env_unset"]))
    console.print(f"NIXL: {escape(report['nixl_install'])}")
    for tip in [*_advice(report), *_hints(report)]:
        console.print(f"[yellow]hint:[/] {escape(tip)}")
    failed = [p for p in report["ports"] if p["free"] is False] + [
        c for c in report["plugin_checks"] if not c["ok"]
    ]
    return 1 if failed else 0
