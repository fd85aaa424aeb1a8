#!/usr/bin/env bash
# Predicted outputs on the shipped `edits` workload's 24 code-edit rows, one server at a time,
# two rounds: with and without each row's prediction at concurrency 1 and 16, a prediction wrong
# from its first token (each row predicting the next row's file), and `--spec-method ngram`
# without and with predictions. Reports go to OUT (default bench-predictions/), a summary line
# per run to stdout. Quiet machine; docs/benchmarks/predictions.md holds the figures.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-bench-predictions}
mkdir -p "$OUT"
$PY - "$OUT/edits-wrong.jsonl" <<'PYEOF'
import json, sys
from zerobubble.bench import resolve_dataset
rows = [json.loads(line) for line in resolve_dataset("edits").read_text().splitlines()]
code = [r for r in rows if r["kind"] == "code-edit"]
wrong = [{**r, "prediction": code[(i + 1) % len(code)]["prediction"]} for i, r in enumerate(code)]
open(sys.argv[1], "w").write("".join(json.dumps(r) + "\n" for r in wrong))
PYEOF
serve() {  # $1: a name for the log; the rest: serve flags
  local name=$1; shift
  $PY -m zerobubble serve --port 50151 --http-port 8151 --metrics-port 9151 --worker-port 50161 "$@" \
    > "$OUT/serve-$name.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 180); do
    $PY -m zerobubble generate --target localhost:50151 --prompt hi --max-tokens 2 >/dev/null 2>&1 && break
    sleep 1
  done
  # Warm-up: four rows the runs below do not use.
  $PY -m zerobubble bench --target localhost:50151 --no-progress --dataset edits --kind doc-revision --limit 4 \
    --concurrency 1 >/dev/null 2>&1
}
stop() { kill "$SERVER"; wait "$SERVER" 2>/dev/null; sleep 2; }
bench() {  # $1: the run's label; the rest: bench flags
  local label=$1; shift
  $PY -m zerobubble bench --target localhost:50151 --no-progress --json "$OUT/$label.json" "$@" > "$OUT/$label.txt" 2>&1
  echo "$label: $(grep -E '^throughput' "$OUT/$label.txt") $(grep -E '^prediction' "$OUT/$label.txt")"
}
serve default --spec-method none
for round in 1 2; do
  bench "c1-prediction-r$round" --dataset edits --kind code-edit --concurrency 1
  bench "c1-none-r$round" --dataset edits --kind code-edit --concurrency 1 --no-prediction
  bench "c1-wrong-r$round" --dataset "$OUT/edits-wrong.jsonl" --concurrency 1
  bench "c16-prediction-r$round" --dataset edits --kind code-edit --concurrency 16
  bench "c16-none-r$round" --dataset edits --kind code-edit --concurrency 16 --no-prediction
done
stop
serve ngram --spec-method ngram
for round in 1 2; do
  bench "c1-ngram-r$round" --dataset edits --kind code-edit --concurrency 1 --no-prediction
  bench "c1-ngram-prediction-r$round" --dataset edits --kind code-edit --concurrency 1
done
stop
