#!/usr/bin/env bash
# `make run`: bring up an embedded cluster (CMS + 2 prefill + 2 decode sim workers + router),
# send DURATION seconds of Poisson arrivals through the public Router API, wait for the last
# request to finish, print the summary, shut everything down.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
LOG=$(mktemp -t slo-router-up.XXXXXX)
RATE=${RATE:-4}
DURATION=${DURATION:-20}
POLICY=${POLICY:-slo}

"$BIN/slo-router" up --prefill 2 --decode 2 --scheduling-policy "$POLICY" --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 >"$LOG" 2>&1 &
UP=$!
cleanup() {
  if kill -0 "$UP" 2>/dev/null; then
    kill -TERM "$UP" 2>/dev/null || true
    wait "$UP" 2>/dev/null || true
  fi
  rm -f "$LOG"
}
trap cleanup EXIT INT TERM

echo "starting an embedded cluster: CMS, 2 prefill + 2 decode simulated workers, router (policy $POLICY)"
ADDR=""
for _ in $(seq 1 600); do
  # `up` prints the policy line last, once every worker has registered and the router sees them.
  if grep -q '^router policy: ' "$LOG"; then
    ADDR=$(sed -n 's/^router listening on //p' "$LOG")
    break
  fi
  if ! kill -0 "$UP" 2>/dev/null; then
    echo "slo-router up exited early:"; cat "$LOG"; exit 1
  fi
  sleep 0.1
done
[ -n "$ADDR" ] || { echo "slo-router up did not start in 60 s:"; cat "$LOG"; exit 1; }
grep -E '^(cms|workers|router)' "$LOG"
echo
echo "sending requests for $DURATION s (Poisson, $RATE req/s, the mixed chat/code/summarize workload);"
echo "the run ends when the last one finishes, up to ~20 s later (the longest requests); about 40 s in all"
"$BIN/slo-router" bench --target "$ADDR" --rate "$RATE" --duration "$DURATION" --workload mixed --seed 0
echo
echo "done; stopping the cluster (RATE=, DURATION= and POLICY= change the run, e.g. POLICY=round-robin make run)"
