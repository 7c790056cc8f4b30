#!/usr/bin/env bash
# CI step: build the abi3 manylinux wheel, install it into a NEW virtualenv
# (no Rust toolchain, no system UCX, no vLLM), and run the installed gateway
# against the installed simulated fleet: one completion streamed, one not,
# /metrics checked. Exits non-zero on the first failure.
#
#   bash scripts/wheel_check.sh                 # build into dist/ and check
#   PDGATE_WHEEL=dist/x.whl bash scripts/wheel_check.sh   # check a built wheel
#
# Environment: PDGATE_VENV (the dev venv holding maturin, default .venv),
# PYTHON (interpreter for the new venv), PDGATE_MANYLINUX (compatibility tag;
# default manylinux_2_28 when zig is available (the `ziglang` package of the
# test extra: maturin --zig links against glibc 2.28), else manylinux_2_34,
# the oldest policy the extension's symbols allow when linked on Debian 12's
# glibc 2.36), PIP_FIND_LINKS (offline mirrors).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${PDGATE_VENV:-.venv}
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
ZIG=()
if [ -n "${PDGATE_MANYLINUX:-}" ]; then
  TAG=$PDGATE_MANYLINUX
elif PATH="$VENV/bin:$PATH" command -v python-zig >/dev/null || command -v zig >/dev/null; then
  TAG=manylinux_2_28
  ZIG=(--zig)
else
  TAG=manylinux_2_34
fi
WORK=$(mktemp -d -t pdgate-wheel-XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
say() { echo "wheel_check: $*"; }
fail() { echo "wheel_check: FAIL: $*" >&2; for f in "$WORK"/*.log; do [ -f "$f" ] && { echo "--- $f" >&2; tail -30 "$f" >&2; }; done; exit 1; }

# 1. Build (release, abi3, manylinux) unless a wheel is given.
if [ -n "${PDGATE_WHEEL:-}" ]; then
  WHEEL=$PDGATE_WHEEL
else
  MATURIN="$VENV/bin/maturin"
  [ -x "$MATURIN" ] || { "$VENV/bin/python" -m pip install -q "maturin>=1.5,<2"; }
  rm -f dist/pdgate-*.whl
  PATH="$VENV/bin:$PATH" CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-2} \
    "$MATURIN" build --release "${ZIG[@]}" --compatibility "$TAG" -o dist \
    >"$WORK/build.log" 2>&1 || fail "maturin build"
  WHEEL=$(ls dist/pdgate-*.whl | head -1)
fi
say "wheel $WHEEL (${ZIG[*]:-no zig})"
case "$WHEEL" in *-cp310-abi3-manylinux*_x86_64.whl) ;; *) fail "not an abi3 manylinux x86_64 wheel: $WHEEL" ;; esac

# 2. The extension links only the C runtime: UCX is dlopen'ed from libucx-cu12.
"$PY" - "$WHEEL" <<'EOF' || fail "external shared-library dependencies"
import subprocess, sys, tempfile, zipfile
allowed = {"libc.so.6", "libm.so.6", "libgcc_s.so.1", "ld-linux-x86-64.so.2", "libpthread.so.0",
           "libdl.so.2", "librt.so.1"}
with zipfile.ZipFile(sys.argv[1]) as z, tempfile.TemporaryDirectory() as d:
    sos = [n for n in z.namelist() if n.endswith(".so") or ".so." in n]
    assert sos == ["pdgate/_native.abi3.so"], f"unexpected shared objects in the wheel: {sos}"
    # the local fleet's start-up hook for its vLLM processes (not a package: no __init__.py)
    assert "pdgate/localfleet/_hooks/sitecustomize.py" in z.namelist(), "localfleet hook missing"
    path = z.extract(sos[0], d)
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    needed = {l.split("[")[1].split("]")[0] for l in out.splitlines() if "(NEEDED)" in l}
    extra = needed - allowed
    assert not extra, f"_native links {sorted(extra)}"
    print("wheel_check: NEEDED", sorted(needed))
EOF

# 3. A fresh venv with the wheel only (pip resolves the light core deps).
"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q --upgrade pip >"$WORK/pip.log" 2>&1 || true
"$WORK/venv/bin/python" -m pip install -q "$WHEEL" >>"$WORK/pip.log" 2>&1 || fail "pip install"
# No Rust, no repo sources, no dev venv on the path from here on.
export PATH="$WORK/venv/bin:/usr/local/bin:/usr/bin:/bin"
cd "$WORK"
if "$WORK/venv/bin/python" -c "import vllm" 2>/dev/null; then fail "vllm got installed"; fi
WANT=$(sed -n 's/^version *= *"\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -1)
GOT=$(pdgate --version)
[ "$GOT" = "pdgate $WANT" ] || fail "pdgate --version says '$GOT', Cargo.toml says $WANT"
python - <<'EOF' || fail "installed package"
import pdgate, pdgate._native
from pdgate.transfer import create_engine
assert "/venv/" in pdgate.__file__, pdgate.__file__
e = create_engine("wheel-check", compat="x", transports="tcp")   # loads libucp from libucx-cu12
print("wheel_check: UCX", e.ucx_version)
e.close()
EOF

# 4. Simulated fleet + gateway, both from the installed console script.
pdgate sim-fleet --prefill 1 --decode 1 --time-scale 20 --info "$WORK/fleet.json" >"$WORK/fleet.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do [ -s "$WORK/fleet.json" ] && break; sleep 0.2; done
[ -s "$WORK/fleet.json" ] || fail "sim-fleet did not start"
P=$(python -c "import json;print(json.load(open('$WORK/fleet.json'))['urls']['prefill'][0])")
D=$(python -c "import json;print(json.load(open('$WORK/fleet.json'))['urls']['decode'][0])")
PORT=$(python -c "import socket;s=socket.socket();s.bind(('127.0.0.1',0));print(s.getsockname()[1])")
pdgate serve --prefill "$P" --decode "$D" --host 127.0.0.1 --port "$PORT" --log-format json \
  >"$WORK/gateway.log" 2>&1 &
PIDS+=($!)
python - "$PORT" <<'EOF' || fail "requests through the installed gateway"
import json, sys, time, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(150):
    try:
        if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
            break
    except OSError:
        time.sleep(0.2)
else:
    raise SystemExit("gateway did not come up")
def post(body):
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=60)
r = post({"model": "sim-model", "prompt": "hello wheel", "max_tokens": 4})
body = json.load(r)
assert r.status == 200 and body["choices"] and body["usage"]["completion_tokens"] == 4, body
r = post({"model": "sim-model", "prompt": "hello stream", "max_tokens": 4, "stream": True})
assert r.headers["content-type"].startswith("text/event-stream"), r.headers["content-type"]
events = [l for l in r.read().decode().splitlines() if l.startswith("data: ")]
assert events[-1] == "data: [DONE]" and len(events) >= 5, events
m = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
ok = [l for l in m.splitlines() if l.startswith('pdgate_requests_total{') and 'outcome="success"' in l]
assert ok and sum(float(l.split()[-1]) for l in ok) == 2, ok
assert "pdgate_time_to_first_token_seconds_bucket" in m
print("wheel_check: 2 completions (JSON + SSE) through the installed gateway, /metrics ok")
EOF
grep -q '"request_id"' "$WORK/gateway.log" || fail "no JSON log line with a request_id"
say "OK"
