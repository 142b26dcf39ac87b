#!/bin/bash
# Two StarFish builds side by side in one run, with the peer suite's StarFish script
# (../shared/bench-peers/starfish.sh): alternating A, B, A, B (ROUNDS times), the same fio suite.
#   A_BIN=/path/old/starfish B_BIN=target/release/starfish [A_LABEL=before] [B_LABEL=after]
#   [VARIANT=starfish-tmpfs|starfish-disk] [ROUNDS=2] [RUNTIME=8] [RAMP=2] bash scripts/bench-ab.sh
# Prints the summary table (median of the rounds, [min–max]). Build A from another commit with
#   git worktree add /tmp/a COMMIT && (cd /tmp/a && CARGO_TARGET_DIR=/tmp/a-target cargo build --release -p starfish)
set -eu
cd "$(dirname "$0")/.."
PEERS=${PEERS:-../shared/bench-peers}
: "${A_BIN:?set A_BIN to the first build starfish binary}"
B_BIN=${B_BIN:-$PWD/target/release/starfish}
A_LABEL=${A_LABEL:-before} B_LABEL=${B_LABEL:-after}
VARIANT=${VARIANT:-starfish-tmpfs} ROUNDS=${ROUNDS:-2}
export OUT=${OUT:-/tmp/starfish-ab}; mkdir -p "$OUT"; rm -f "$OUT/all.jsonl"
export JSON_OUT=$OUT/all.jsonl RUNTIME=${RUNTIME:-8} RAMP=${RAMP:-2}
# The peer script labels rows by variant: a copy that appends each build's label.
COPY=$(mktemp -d); trap 'rm -rf "$COPY"' EXIT
cp -r "$PEERS"/. "$COPY"/
sed -i 's/--label \$v /--label $v${LABEL_SUFFIX:-} /' "$COPY/starfish.sh"
for round in $(seq "$ROUNDS"); do
  STARFISH_BIN=$A_BIN LABEL_SUFFIX=-$A_LABEL VARIANTS=$VARIANT bash "$COPY/starfish.sh" > "$OUT/$A_LABEL-$round.txt" 2>&1
  STARFISH_BIN=$B_BIN LABEL_SUFFIX=-$B_LABEL VARIANTS=$VARIANT bash "$COPY/starfish.sh" > "$OUT/$B_LABEL-$round.txt" 2>&1
done
python3 "$COPY/lib/summarize.py" "$OUT/all.jsonl" --spread
