"""The ``pdgate`` command line.

Subcommands:

- ``pdgate serve``: run the gateway (``--prefill URL ... --decode URL ... --port N``);
- ``pdgate check-config``: validate a config and print the effective one;
- ``pdgate sim-fleet``: run simulated vLLM instances;
- ``pdgate bench {replay,goodput,overhead} ...``: the benchmarks.

``serve`` and ``check-config`` take every config field as a flag, from a
``--config`` file (YAML/JSON) and from ``PDGATE_*`` environment variables;
precedence defaults < file < environment < flags (:mod:`pdgate.settings`).
Flag names follow vllm-router's where they mean the same (``--prefill``,
``--decode``, ``--policy``, ``--prefill-policy``, ``--decode-policy``,
``--port``, ``--prometheus-port``, ``--service-discovery``...).
Exit codes: 0 ok, 2 invalid configuration or usage.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from pydantic import ValidationError

from pdgate import __version__

BENCHES = {
    "replay": "pdgate.bench.replay",
    "goodput": "pdgate.bench.goodput",
    "overhead": "pdgate.bench.overhead",
}


def _config_parser(sub: Any, name: str, help_: str) -> argparse.ArgumentParser:
    from pdgate.settings import add_config_flags

    p = sub.add_parser(name, help=help_, description=help_)
    add_config_flags(p)
    return p


def build_parser() -> argparse.ArgumentParser:
    """The top-level argument parser."""
    parser = argparse.ArgumentParser(prog="pdgate", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"pdgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _config_parser(sub, "serve", "run the gateway in front of prefill and decode instances")
    check = _config_parser(sub, "check-config", "validate a config and print the effective one")
    check.add_argument("--format", choices=["yaml", "json"], default="yaml", help="output format")
    from pdgate.sim.cli import add_parser as _sim_fleet_parser

    parser.set_defaults(_sim_fleet_parser=_sim_fleet_parser(sub))
    bench = sub.add_parser("bench", help="run a benchmark (arguments go to it; see its --help)")
    bench.add_argument("bench", choices=sorted(BENCHES), help="which benchmark")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


def _load(args: argparse.Namespace, prog: str) -> Any:
    """The effective config, or ``None`` after printing why it is invalid."""
    from pdgate.settings import config_from_args

    try:
        return config_from_args(args)
    except (ValidationError, ValueError, OSError) as e:
        print(f"pdgate {prog}: invalid configuration:\n{e}", file=sys.stderr)
        return None


def cmd_serve(args: argparse.Namespace) -> int:
    """Validate the config and run the gateway until drained after SIGTERM; returns an exit code."""
    config = _load(args, "serve")
    if config is None:
        return 2
    if config.discovery.type == "kubernetes":
        try:
            import kubernetes  # noqa: F401
        except ImportError:
            print("pdgate serve: discovery.type kubernetes needs the kubernetes client: "
                  "pip install 'pdgate[k8s]'", file=sys.stderr)
            return 2
    from pdgate.gateway.serve import serve
    from pdgate.logs import configure_logging

    configure_logging(config.log_level, config.log_format)
    return serve(config)  # drains on SIGTERM (config.drain), exits 0


def cmd_check_config(args: argparse.Namespace) -> int:
    """Print the effective config (exit 0) or the validation errors (exit 2)."""
    config = _load(args, "check-config")
    if config is None:
        return 2
    from pdgate.settings import dump_config

    sys.stdout.write(dump_config(config, args.format))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Run ``pdgate.bench.<name>.main(args)``."""
    import importlib

    try:
        mod = importlib.import_module(BENCHES[args.bench])
    except ImportError as e:
        print(f"pdgate bench {args.bench}: missing dependency ({e}); "
              "install the bench extra: pip install 'pdgate[bench]'", file=sys.stderr)
        return 2
    argv = list(args.args)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    return int(mod.main(argv) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pdgate`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "check-config":
        return cmd_check_config(args)
    if args.command == "bench":
        return cmd_bench(args)
    if args.command == "sim-fleet":
        import os

        from pdgate.settings import apply_file_env_defaults
        from pdgate.sim.cli import run as cmd_sim_fleet

        try:
            apply_file_env_defaults(args._sim_fleet_parser, args.config or os.environ.get("PDGATE_SIM_FLEET_CONFIG"),
                                    os.environ, "PDGATE_SIM_FLEET_")
        except (ValueError, OSError) as e:
            print(f"pdgate sim-fleet: invalid configuration: {e}", file=sys.stderr)
            return 2
        args = parser.parse_args(argv)  # flags over the file/env defaults
        return cmd_sim_fleet(args)
    return 2  # pragma: no cover - argparse enforces the subcommand


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
