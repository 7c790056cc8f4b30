"""Step and request traces of simulated instances, for policy studies.

Set ``PDGATE_SIM_TRACE_DIR`` (or pass ``trace_dir`` to :class:`SimFleet`)
and every simulated engine writes two CSV files there:

- ``<engine>.steps.csv``: one line per step: ``start_s`` (simulated
  seconds), ``duration_s``, ``prefill_tokens`` (chunk tokens in the step),
  ``decode_seqs``, ``waiting`` and ``running`` (requests, after scheduling);
- ``<engine>.requests.csv``: one line per first token: ``kind`` (``pd``:
  a consumer whose KV came from a prefill instance; ``local``: prefilled
  here, a consumer whose KV load failed included), ``prompt_tokens``,
  ``arrival_s``, ``kv_loaded_s`` (``pd`` only, else -1) and
  ``first_token_s``.

The environment variable reaches the simulator processes the benchmarks
start, so ``PDGATE_SIM_TRACE_DIR=/tmp/t bench/goodput.py ...`` traces a run.
:func:`summarize` (CLI: ``bench/sim_trace.py DIR``) prints each
instance's busy share and prefill tokens per second over a window, and the
waits of the P/D requests on the decode instances: from arrival to the KV
loaded (vLLM starts a load only while the running requests leave token
budget, ``vllm/v1/core/sched/scheduler.py``), and from there to the first
token.
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
from typing import IO, Any

ENV = "PDGATE_SIM_TRACE_DIR"
STEP_FIELDS = ("start_s", "duration_s", "prefill_tokens", "decode_seqs", "waiting", "running")
REQUEST_FIELDS = ("kind", "prompt_tokens", "arrival_s", "kv_loaded_s", "first_token_s")


class EngineTrace:
    """The two CSV files of one engine (line-buffered; :meth:`close` when done).

    Args:
        directory: where to write (created if missing).
        engine_id: file name stem.
    """

    def __init__(self, directory: str, engine_id: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self._steps = self._open(os.path.join(directory, f"{engine_id}.steps.csv"), STEP_FIELDS)
        self._requests = self._open(os.path.join(directory, f"{engine_id}.requests.csv"), REQUEST_FIELDS)

    @staticmethod
    def _open(path: str, fields: tuple[str, ...]) -> IO[str]:
        new = not os.path.exists(path)
        f = open(path, "a", buffering=1)
        if new:
            f.write(",".join(fields) + "\n")
        return f

    def step(self, start_s: float, duration_s: float, prefill_tokens: int, decode_seqs: int,
             waiting: int, running: int) -> None:
        """One step (simulated seconds; tokens; request counts)."""
        self._steps.write(f"{start_s:.4f},{duration_s:.4f},{prefill_tokens},{decode_seqs},{waiting},{running}\n")

    def first_token(self, kind: str, prompt_tokens: int, arrival_s: float, kv_loaded_s: float | None,
                    first_token_s: float) -> None:
        """A request's first token (simulated seconds; ``kv_loaded_s`` None unless ``kind == "pd"``)."""
        loaded = -1.0 if kv_loaded_s is None else kv_loaded_s
        self._requests.write(f"{kind},{prompt_tokens},{arrival_s:.4f},{loaded:.4f},{first_token_s:.4f}\n")

    def close(self) -> None:
        self._steps.close()
        self._requests.close()


def _read(path: str) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else float("nan")


def summarize(directory: str, start_s: float | None = None, end_s: float | None = None) -> dict[str, Any]:
    """Per engine over ``[start_s, end_s)`` (simulated seconds from the first step
    of any engine; default the whole trace): ``busy`` (share of the window spent
    in steps), ``prefill_tokens_per_s``, ``steps``, ``idle_prefill_steps`` (steps
    with no prefill chunk); and over the decode engines' P/D requests the
    ``arrival_to_loaded_s`` and ``loaded_to_first_s`` p50/p90.

    Raises:
        FileNotFoundError: no trace files in ``directory``.
    """
    steps = {os.path.basename(p)[: -len(".steps.csv")]: _read(p)
             for p in sorted(glob.glob(os.path.join(directory, "*.steps.csv")))}
    if not steps:
        raise FileNotFoundError(f"no *.steps.csv in {directory}")
    t0 = min(float(rows[0]["start_s"]) for rows in steps.values() if rows)
    t_end = max(float(r["start_s"]) + float(r["duration_s"]) for rows in steps.values() for r in rows)
    lo = t0 + (start_s or 0.0)
    hi = t0 + end_s if end_s is not None else t_end
    span = max(hi - lo, 1e-9)
    out: dict[str, Any] = {"window_s": [lo - t0, hi - t0], "engines": {}}
    for name, rows in steps.items():
        sel = [r for r in rows if lo <= float(r["start_s"]) < hi]
        out["engines"][name] = {
            "busy": sum(float(r["duration_s"]) for r in sel) / span,
            "prefill_tokens_per_s": sum(int(r["prefill_tokens"]) for r in sel) / span,
            "steps": len(sel),
            "idle_prefill_steps": sum(1 for r in sel if int(r["prefill_tokens"]) == 0),
        }
    pd = [r for p in glob.glob(os.path.join(directory, "*.requests.csv")) for r in _read(p)
          if r["kind"] == "pd" and lo <= float(r["arrival_s"]) < hi]
    to_loaded = [float(r["kv_loaded_s"]) - float(r["arrival_s"]) for r in pd]
    to_first = [float(r["first_token_s"]) - float(r["kv_loaded_s"]) for r in pd]
    out["pd_requests"] = len(pd)
    for key, xs in (("arrival_to_loaded_s", to_loaded), ("loaded_to_first_s", to_first)):
        out[key] = {"p50": _pct(xs, 0.5), "p90": _pct(xs, 0.9)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Summarize a simulated fleet's step and request traces.")
    ap.add_argument("directory")
    ap.add_argument("--start-s", type=float, help="window start, simulated s after the first step")
    ap.add_argument("--end-s", type=float, help="window end, simulated s after the first step")
    args = ap.parse_args(argv)
    s = summarize(args.directory, args.start_s, args.end_s)
    print(f"window {s['window_s'][0]:.1f}-{s['window_s'][1]:.1f} s (simulated)")
    for name, e in s["engines"].items():
        print(f"  {name:>16}: busy {e['busy']:5.1%}  prefill {e['prefill_tokens_per_s'] / 1000:6.1f}k tokens/s  "
              f"steps {e['steps']} ({e['idle_prefill_steps']} without a prefill chunk)")
    if s["pd_requests"]:
        a, b = s["arrival_to_loaded_s"], s["loaded_to_first_s"]
        print(f"  P/D requests on decode instances: {s['pd_requests']}; arrival -> KV loaded p50 "
              f"{a['p50']:.3f} s p90 {a['p90']:.3f} s; KV loaded -> first token p50 {b['p50']:.3f} s "
              f"p90 {b['p90']:.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
