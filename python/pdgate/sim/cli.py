"""``pdgate sim-fleet``: run simulated vLLM instances until interrupted.

Prints one JSON line (the fleet description: urls per role, profile,
time scale) on stdout once every instance listens, and writes it to
``--info FILE`` when given, so scripts can start a fleet and read its urls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from typing import Any


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    """Register the ``sim-fleet`` subcommand; returns its parser.

    Every flag can also come from ``--config FILE`` (YAML/JSON, keys = flag
    names) and ``PDGATE_SIM_FLEET_<FLAG>`` (e.g. ``PDGATE_SIM_FLEET_TIME_SCALE``);
    precedence defaults < file < environment < flags.
    """
    p = sub.add_parser("sim-fleet", help="run simulated vLLM instances (vLLM-compatible HTTP API)")
    p.add_argument("--config", help="YAML/JSON file of these flags (env PDGATE_SIM_FLEET_<FLAG> overrides it)")
    p.add_argument("--prefill", type=int, default=1, help="prefill instances (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode instances (default 1)")
    p.add_argument("--both", type=int, default=0, help="aggregated instances (prefill and decode)")
    p.add_argument("--profile", default="cpu-tiny",
                   help="profile name (a100-dsv2-lite, h100-llama3-8b, cpu-tiny) or YAML path")
    # --speed, as in bench/goodput.py; --time-scale is the older name (not
    # replay.py's --time-scale, which stretches a trace's inter-arrival gaps)
    p.add_argument("--speed", "--time-scale", dest="time_scale", type=float, default=1.0, metavar="X",
                   help="simulated seconds per wall second (10 = ten times faster than real time); "
                        "--time-scale is an alias")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default loopback)")
    p.add_argument("--port", type=int, default=0, help="first port; instances take consecutive ports "
                                                       "(default: free ports)")
    p.add_argument("--model", default="sim-model", help="served model name")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a profile field, e.g. --set max_num_seqs=128")
    for role in ("prefill", "decode", "both"):
        p.add_argument(f"--{role}-set", action="append", default=[], metavar="FIELD=VALUE",
                       help=f"override a profile field for {role} instances only")
    p.add_argument("--info", help="write the fleet description JSON here")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return p


def _overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep:
            raise ValueError(f"--set needs FIELD=VALUE, got {it!r}")
        out[k.strip()] = json.loads(v) if v.strip()[:1] in "0123456789-[{\"tf" else v
    return out


def run(args: argparse.Namespace) -> int:
    """Start the fleet in this process's loop; returns an exit code."""
    from pdgate.sim.fleet import SimFleet
    from pdgate.sim.profiles import load_profile

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        profile = load_profile(args.profile, **_overrides(args.set))
        roles = {r: _overrides(getattr(args, f"{r}_set")) for r in ("prefill", "decode", "both")}
        for r, o in roles.items():
            profile.replace(**o)  # validate now: a bad field is a usage error, not a crash later
    except (OSError, ValueError, TypeError) as e:
        print(f"pdgate sim-fleet: bad profile: {e}", file=sys.stderr)
        return 2
    n = args.prefill + args.decode + args.both
    usage = None
    if min(args.prefill, args.decode, args.both) < 0 or n < 1:
        usage = (f"instance counts must be >= 0 with at least one instance "
                 f"(got --prefill {args.prefill} --decode {args.decode} --both {args.both})")
    elif not args.time_scale > 0:
        usage = f"--speed must be > 0 (got {args.time_scale:g})"
    if usage:
        print(f"pdgate sim-fleet: {usage}", file=sys.stderr)
        return 2
    ports = [args.port + i for i in range(n)] if args.port else None
    fleet = SimFleet(args.prefill, args.decode, args.both, profile=profile, time_scale=args.time_scale,
                     model=args.model, policy=args.scheduling_policy, host=args.host, ports=ports,
                     enable_prefix_caching=not args.no_prefix_caching, role_overrides=roles)

    async def main() -> None:
        await fleet.astart()
        info = json.dumps(fleet.describe())
        if args.info:
            with open(args.info, "w") as f:
                f.write(info)
        print(info, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await fleet.astop()

    asyncio.run(main())
    return 0
