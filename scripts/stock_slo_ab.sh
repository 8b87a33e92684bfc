#!/bin/bash
# slo with the agents' decode-step estimate, slo without it, and load-balance, through the router
# on two unmodified vLLM gRPC engines of unequal size (--max-num-seqs 32 and 4) sharing one host.
# One CMS per agent setting (agents with --step-estimate on / off poll the same engines); the
# routers run alternately on the same workload, rate and seed. Figures: OUT/summary.txt.
#
#   MODEL=/tmp/tiny PROFILE=DIR scripts/stock_slo_ab.sh "28 5" "34 7" "40 8"
#
# MODEL: a model directory (python -m workers.vllm_tiny_model /tmp/tiny makes the tiny one);
# PROFILE: ttft.json + tpot.json from `slo-router profile` of that model on this host;
# arguments: "RATE SEED" pairs (default: "28 5" "40 6" "34 7" "40 8").
set -u
cd "$(dirname "$0")/.."
MODEL=${MODEL:-/tmp/tiny}
PROFILE=${PROFILE:?set PROFILE to a slo-router profile directory}
WORKLOAD=${WORKLOAD:-scripts/stock-mixed.json}
OUT=${OUT:-/tmp/stock-slo-ab}
DURATION=${DURATION:-30}
mkdir -p "$OUT"
export VLLM_CPU_KVCACHE_SPACE=1 SMG_VLLM_SERVICER_WARMUP=off HF_HUB_OFFLINE=1
B=.venv/bin/slo-router
pids=()
cleanup() { for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill "${pids[i]}" 2>/dev/null; done; }
trap cleanup EXIT
engine() { # port max_num_seqs log
  .venv-vllm/bin/python -m vllm.entrypoints.launchers.grpc_server --model "$MODEL" --host 127.0.0.1 \
    --port "$1" --dtype float32 --enforce-eager --max-model-len 1024 --max-num-seqs "$2" > "$OUT/$3" 2>&1 &
  pids+=($!)
}
bg() { local log=$1; shift; "$B" "$@" > "$OUT/$log" 2>&1 & pids+=($!); }
engine 18851 32 x.log
engine 18852 4 y.log
bg cms-est.log cms --listen 127.0.0.1:18860
bg cms-off.log cms --listen 127.0.0.1:18861
sleep 3
# The engines took over 5 minutes to start on a busy host: the agents wait as long as the script.
wait_s=(--engine-wait-s 900)
bg agent-x-est.log agent --engine 127.0.0.1:18851 --cms 127.0.0.1:18860 --instance-id x32 "${wait_s[@]}"
bg agent-y-est.log agent --engine 127.0.0.1:18852 --cms 127.0.0.1:18860 --instance-id y4 "${wait_s[@]}"
bg agent-x-off.log agent --engine 127.0.0.1:18851 --cms 127.0.0.1:18861 --instance-id x32 --step-estimate off "${wait_s[@]}"
bg agent-y-off.log agent --engine 127.0.0.1:18852 --cms 127.0.0.1:18861 --instance-id y4 --step-estimate off "${wait_s[@]}"
common=(--profile "$PROFILE" --tokenizer "$MODEL")
bg router-slo-est.log router --cms grpc://127.0.0.1:18860 --listen 127.0.0.1:18870 "${common[@]}" --scheduling-policy slo
bg router-slo.log router --cms grpc://127.0.0.1:18861 --listen 127.0.0.1:18871 "${common[@]}" --scheduling-policy slo
bg router-lb.log router --cms grpc://127.0.0.1:18861 --listen 127.0.0.1:18872 "${common[@]}" --scheduling-policy load-balance
n=0
for _ in $(seq 900); do
  n=$(grep -l "registered vLLM engine" "$OUT"/agent-*.log 2>/dev/null | wc -l)
  [ "$n" = 4 ] && break
  sleep 1
done
[ "$n" = 4 ] || { echo "the agents did not register within 900 s (see $OUT)"; exit 1; }
sleep 5
run() { # name port rate seed
  local out="$OUT/r$3-s$4-$1"
  "$B" bench --engine vllm --target "127.0.0.1:$2" --workload "$WORKLOAD" --rate "$3" --duration "$DURATION" --seed "$4" \
    --output "$out.json" --no-progress > "$out.txt" 2>&1
  python3 - "$out.json" "$1" "$3" "$4" <<'PY' | tee -a "$OUT/summary.txt"
import json, os, sys
d = json.load(open(sys.argv[1])); o = d["overall"]; c = d["classes"]
print(f"{sys.argv[2]} rate {sys.argv[3]} seed {sys.argv[4]}: attainment {100 * o['slo_attainment']:.1f}% "
      f"(interactive {100 * c['interactive']['slo_attainment']:.1f}%, batch {100 * c['batch']['slo_attainment']:.1f}%) "
      f"goodput {o['goodput_rps']:.1f}/s, load average {os.getloadavg()[0]:.1f}")
PY
}
[ $# -gt 0 ] || set -- "28 5" "40 6" "34 7" "40 8"
for pair in "$@"; do
  read -r rate seed <<< "$pair"
  run slo-est 18870 "$rate" "$seed"; sleep 3
  run slo 18871 "$rate" "$seed"; sleep 3
  run lb 18872 "$rate" "$seed"; sleep 3
done
