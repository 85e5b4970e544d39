"""The ``p2pkv proxy`` subcommand, contributed to the ``p2pkv`` CLI through the plugin hook.

This module is the distribution's ``p2pkv`` entry point. It imports neither vLLM nor the
proxy's HTTP stack: those load when the command runs, with a clear message if the ``proxy``
extra is missing.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict
from typing import Any

from p2pkv.errors import ConfigError
from p2pkv.hookspecs import hookimpl

from p2pkv_vllm.proxy.config import (
    INSTANCE_OPTIONS,
    Mode,
    PrefillFailure,
    ProxyConfig,
    ProxyTimeouts,
    load_config_file,
    parse_decoder,
    parse_prefiller,
)

__all__ = ["P2PKV_PLUGIN_API", "config_from_args", "p2pkv_cli_commands"]

P2PKV_PLUGIN_API = 1

_TIMEOUT_FLAGS = {f"{name}_timeout": name for name in ("connect", "prefill", "decode", "idle")}


@hookimpl
def p2pkv_cli_commands(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "proxy",
        help="OpenAI-compatible PD router pairing vLLM prefillers and decoders over the P2P tier",
        description=(
            "Route /v1/completions and /v1/chat/completions through a prefill leg and a decode "
            "leg joined by a fresh kv_request_id. See docs/proxy.md."
        ),
        epilog="per-instance options (--prefiller/--decoder URL,OPT=V,...):\n"
        + "\n".join(f"  {name:<10} {meaning}" for name, meaning in INSTANCE_OPTIONS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="FILE", help="JSON or TOML config file (flags win)")
    p.add_argument(
        "--prefiller",
        action="append",
        default=[],
        metavar="URL[,OPT=V...]",
        help="prefill instance (repeatable; options below)",
    )
    p.add_argument(
        "--decoder",
        action="append",
        default=[],
        metavar="URL[,OPT=V...]",
        help="decode instance (repeatable; options below)",
    )
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8192, help="listen port (default 8192, 0 = any)")
    p.add_argument(
        "--mode", choices=[m.value for m in Mode], help="leg order (default prefiller-first)"
    )
    p.add_argument(
        "--on-prefill-failure",
        choices=[f.value for f in PrefillFailure],
        help="decode without remote KV (recompute, default) or answer 502 (fail)",
    )
    p.add_argument(
        "--policy",
        help="slot selection: round-robin (default), least-inflight, "
        "prefix-aware, kv-indexer, or module:factory "
        "(docs/prefix-routing.md)",
    )
    p.add_argument(
        "--min-cached-tokens-delta",
        type=int,
        metavar="TOKENS",
        help="prefix policies: name a remote_kv_source only when it holds at least "
        "this many more prompt tokens than the chosen prefiller (default 256)",
    )
    p.add_argument(
        "--indexer-url",
        metavar="URL",
        help="kv-indexer policy: the external indexer (Mooncake RFC #1403 HTTP API)",
    )
    p.add_argument(
        "--warm-pairs",
        action="store_true",
        default=None,
        help="at startup, open the P2P session of every instance pair with one tiny "
        "PD request each, so the first user request between two instances "
        "does not pay the session setup (docs/prefix-routing.md)",
    )
    for flag, name in _TIMEOUT_FLAGS.items():
        p.add_argument(
            f"--{flag.replace('_', '-')}",
            type=float,
            metavar="SECONDS",
            help=f"{name} timeout (default {getattr(ProxyTimeouts(), name):g}s)",
        )
    p.add_argument("--max-connections", type=int, help="pooled upstream connections (1024)")
    p.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="environment variable holding a key sent to upstreams as "
        "'Authorization: Bearer' when the client sent no auth header",
    )
    p.add_argument("--no-access-log", action="store_true", help="do not write the access log")
    p.set_defaults(func=_run)


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """The proxy config from ``--config`` overlaid with the flags; raises ``ConfigError``."""
    raw: dict[str, Any] = load_config_file(args.config) if args.config else {}
    if args.prefiller:
        raw["prefillers"] = [asdict(parse_prefiller(spec)) for spec in args.prefiller]
    if args.decoder:
        raw["decoders"] = [asdict(parse_decoder(spec)) for spec in args.decoder]
    for key in ("mode", "on_prefill_failure", "policy", "max_connections", "warm_pairs"):
        if getattr(args, key) is not None:
            raw[key] = getattr(args, key)
    _overlay(
        raw,
        "prefix_routing",
        {
            key: getattr(args, key)
            for key in ("min_cached_tokens_delta", "indexer_url")
            if getattr(args, key) is not None
        },
    )
    _overlay(
        raw,
        "timeouts",
        {
            name: getattr(args, flag)
            for flag, name in _TIMEOUT_FLAGS.items()
            if getattr(args, flag) is not None
        },
    )
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise ConfigError(f"--api-key-env: environment variable {args.api_key_env} is not set")
        raw["api_key"] = api_key
    return ProxyConfig.from_mapping(raw, source=args.config or "flags")


def _overlay(raw: dict[str, Any], table: str, flags: dict[str, Any]) -> None:
    """Flags given for keys of the config table ``table`` win over the file's values."""
    if flags:
        from_file = raw.get(table, {})
        raw[table] = {**(from_file if isinstance(from_file, dict) else {}), **flags}


def _run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"p2pkv proxy: {exc}", file=sys.stderr)
        return 2
    try:
        from p2pkv_vllm.proxy import server
    except ModuleNotFoundError as exc:
        print(
            f"p2pkv proxy needs the 'proxy' extra ({exc.name} is missing): "
            "pip install 'p2pkv-vllm[proxy]'",
            file=sys.stderr,
        )
        return 2
    try:
        return server.run(
            config,
            args.host,
            args.port,
            log_level=args.log_level,
            access_log=not args.no_access_log,
        )
    except OSError as exc:
        print(
            f"p2pkv proxy: cannot listen on {args.host}:{args.port}: {exc.strerror}",
            file=sys.stderr,
        )
        return 1
