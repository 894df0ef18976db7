#!/bin/bash
# CPU time the API process (HTTP, SSE framing, metrics; not the engine) spends per streamed
# token: start `python -m server` on MODEL, stream N random-prompt requests through
# bench/serving.py, read the API process's utime+stime from /proc before and after.
#   bash bench/api_cpu_per_token.sh [MODEL] [NUM_PROMPTS] [CONCURRENCY] [OUTPUT_LEN]
set -u
cd "$(dirname "$0")/.."
MODEL=${1:-tests/fixtures/stories260K}; N=${2:-96}; C=${3:-48}; OUT=${4:-200}
PORT=$((20000 + RANDOM % 10000))
setsid python -m server --model-path "$MODEL" --port $PORT --log-level warning \
    > /tmp/api-cpu-server.log 2>&1 &
SPID=$!
trap 'kill -- -$SPID 2>/dev/null' EXIT
for _ in $(seq 1 180); do
  curl -s -o /dev/null -w "%{http_code}" localhost:$PORT/health_generate 2>/dev/null | grep -q 200 && break
  sleep 1
done
read -r U0 S0 < <(awk '{print $14, $15}' /proc/$SPID/stat)
python bench/serving.py --port $PORT --dataset-name random --random-input-len 32 \
  --random-output-len $OUT --num-prompts $N --max-concurrency $C --disable-tqdm \
  | grep "Output token throughput"
read -r U1 S1 < <(awk '{print $14, $15}' /proc/$SPID/stat)
TICKS=$(( U1 - U0 + S1 - S0 )); HZ=$(getconf CLK_TCK)
echo "API process CPU: $(( TICKS * 1000 / HZ )) ms for $(( N * OUT )) streamed tokens =" \
     "$(( TICKS * 1000000 / HZ / (N * OUT) )) us/token"
