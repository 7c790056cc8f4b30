"""The ``pdgate`` command line.

``pdgate serve --prefill URL [URL ...] --decode URL [URL ...] --port N``
starts the gateway; ``--config FILE`` (YAML or JSON) supplies defaults that
flags override. Flag names follow vllm-router's where they mean the same.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from pydantic import ValidationError

from pdgate import __version__


def _serve_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("serve", help="run the gateway in front of prefill and decode instances")
    p.add_argument("--config", help="YAML or JSON config file (flags override it)")
    p.add_argument("--prefill", nargs="+", metavar="URL", help="prefill instance base URLs")
    p.add_argument("--decode", nargs="+", metavar="URL", help="decode instance base URLs")
    p.add_argument("--host", help="listen address (default 0.0.0.0)")
    p.add_argument("--port", type=int, help="listen port (default 8000)")
    p.add_argument("--prefill-policy", help="routing policy for the prefill leg (default round_robin)")
    p.add_argument("--decode-policy", help="routing policy for the decode leg (default round_robin)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])


def build_parser() -> argparse.ArgumentParser:
    """The top-level argument parser (subcommands: ``serve``, ``sim-fleet``)."""
    parser = argparse.ArgumentParser(prog="pdgate", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"pdgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    from pdgate.sim.cli import add_parser as _sim_fleet_parser

    _sim_fleet_parser(sub)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    """Validate the config and run the gateway until drained after SIGTERM; returns an exit code."""
    from pdgate.config import load_config

    try:
        config = load_config(
            args.config,
            prefill=args.prefill,
            decode=args.decode,
            host=args.host,
            port=args.port,
            prefill_policy=args.prefill_policy,
            decode_policy=args.decode_policy,
            log_level=args.log_level,
        )
    except (ValidationError, ValueError, OSError) as e:
        print(f"pdgate: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    from pdgate.gateway.serve import serve

    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(config)  # drains on SIGTERM (config.drain), exits 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pdgate`` console script."""
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "sim-fleet":
        from pdgate.sim.cli import run as cmd_sim_fleet

        return cmd_sim_fleet(args)
    return 2  # pragma: no cover - argparse enforces the subcommand


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
