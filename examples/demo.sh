#!/usr/bin/env bash
# deja end to end, offline: record the retry-spiral agent against the bundled stub model,
# stop the model, replay the run from its cassette, and show it step by step.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${BIN:-.venv/bin}"
OUT=cassettes/demo
mkdir -p "$OUT"
READY="$(mktemp -u)"
# The signing key is yours, as for every deja command: $DEJA_HOME/key (~/.deja/key),
# made on first use; the commands you type after the demo verify its cassettes with it.

echo "== 1. start the stub model server (scripted Anthropic Messages API on 127.0.0.1)"
"$BIN/deja" stub --script examples/retry_spiral.stub.json --port 0 --ready-file "$READY" &
STUB=$!
trap 'kill $STUB 2>/dev/null || true; rm -f "$READY"' EXIT
for _ in $(seq 100); do [ -s "$READY" ] && break; sleep 0.05; done
export ANTHROPIC_BASE_URL="$(cat "$READY")"

echo "== 2. record the unmodified agent: deja record -- python examples/retry_spiral.py"
"$BIN/deja" record -o "$OUT/retry_spiral.jsonl" --force --label example=retry_spiral \
    -- python examples/retry_spiral.py || true

echo "== 3. stop the model server: from here on nothing can answer on the network"
kill "$STUB"; wait "$STUB" 2>/dev/null || true
unset ANTHROPIC_BASE_URL

echo "== 4. replay offline: deja replay $OUT/retry_spiral.jsonl"
"$BIN/deja" replay "$OUT/retry_spiral.jsonl"

echo "== 5. verify the signature chain and show the run"
"$BIN/deja" verify "$OUT/retry_spiral.jsonl"
"$BIN/deja" show "$OUT/retry_spiral.jsonl"
"$BIN/deja" ls "$OUT"
