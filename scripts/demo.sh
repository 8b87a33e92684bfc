#!/usr/bin/env bash
# `make run`: bring up an embedded cluster (CMS + 2 prefill + 2 decode sim workers + router),
# drive a ~20 s workload through the public Router API, print the summary, shut everything down.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
LOG=$(mktemp -t slo-router-up.XXXXXX)
RATE=${RATE:-4}
DURATION=${DURATION:-20}
POLICY=${POLICY:-slo}

"$BIN/slo-router" up --prefill 2 --decode 2 --scheduling-policy "$POLICY" --listen 127.0.0.1:0 >"$LOG" 2>&1 &
UP=$!
cleanup() {
  if kill -0 "$UP" 2>/dev/null; then
    kill -TERM "$UP" 2>/dev/null || true
    wait "$UP" 2>/dev/null || true
  fi
  rm -f "$LOG"
}
trap cleanup EXIT INT TERM

ADDR=""
for _ in $(seq 1 600); do
  ADDR=$(sed -n 's/^router listening on //p' "$LOG")
  [ -n "$ADDR" ] && break
  if ! kill -0 "$UP" 2>/dev/null; then
    echo "slo-router up exited early:"; cat "$LOG"; exit 1
  fi
  sleep 0.1
done
[ -n "$ADDR" ] || { echo "slo-router up did not start in 60 s:"; cat "$LOG"; exit 1; }
grep -E '^(cms|workers|router)' "$LOG"
"$BIN/slo-router" bench --target "$ADDR" --rate "$RATE" --duration "$DURATION" --workload mixed --seed 0
