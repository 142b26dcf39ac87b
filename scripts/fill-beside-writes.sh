#!/usr/bin/env bash
# Large writes into holes beside small writes (issue 16; figures in docs/benchmarks.md): a fresh
# cluster (three elements with their data in DATA, default the disk under /var/tmp; a host
# element on loopback, Q=2, one 1 GiB volume) per case, its first half filled with 1 MiB writes,
# then one fio run of two jobs for RUNTIME s: 4 KiB random writes at QD16 over the filled half,
# and 1 MiB sequential writes at QD4 into the empty half, held to 30 MB/s. The cases alternate,
# ROUNDS times: the elements' defaults, `--placed-writes`, and, with OLD_SF=<another build>,
# that build with `--placed-writes`. Prints the small writes' IOPS, mean, p99 and p99.9 latency
# and the large writes' mean and p99: what placing large writes costs the writes beside them.
#   bash scripts/fill-beside-writes.sh                  # DATA=/var/tmp ROUNDS=3 RUNTIME=15
#   OLD_SF=/tmp/old/starfish ROUNDS=3 bash scripts/fill-beside-writes.sh
# Builds nothing: uses target/release/starfish (or SF=). The machine is shared and noisy:
# compare within one run.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-/var/tmp}
ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-15}
BASE=${BASE_PORT:-11040}
NEW_SF=${SF:-$PWD/target/release/starfish}
DIR=$(mktemp -d "$DATA/starfish-fill-beside.XXXXXX")
source scripts/lib/cluster.sh
trap cleanup EXIT

case_run() { # label binary element-arguments...: one fresh cluster, one run, one line
    local label=$1
    SF=$2 SFE=$2
    shift 2
    ELEMENT_ARGS=("$@")
    PIDS=()
    rm -rf "${DIR:?}"/*
    start_cluster
    fio --name=fill --ioengine=nbd --uri="nbd://127.0.0.1:$BASE/vol0" --rw=write --bs=1m --iodepth=16 \
        --size=512m >/dev/null 2>&1
    fio --ioengine=nbd --uri="nbd://127.0.0.1:$BASE/vol0" --time_based --runtime="$RUNTIME" --output-format=json \
        --name=small --rw=randwrite --bs=4k --iodepth=16 --offset=0 --size=512m \
        --name=large --rw=write --bs=1m --iodepth=4 --offset=512m --size=512m --rate=30m 2>/dev/null |
        /usr/bin/python3 -c "
import json, sys
text = sys.stdin.read(); jobs = json.loads(text[text.index('{'):])['jobs']
s, l = jobs[0]['write'], jobs[1]['write']
p, q = s['clat_ns']['percentile'], l['clat_ns']['percentile']
print(f\"{'$label':<22} 4 KiB: {s['iops']:6.0f} IOPS, mean {s['lat_ns']['mean'] / 1e3:5.0f} µs, p99 {p['99.000000'] / 1e3:6.0f} µs, \"
      f\"p99.9 {p['99.900000'] / 1e3:6.0f} µs | 1 MiB: {l['bw'] * 1024 / 1e6:3.0f} MB/s, mean {l['lat_ns']['mean'] / 1e6:5.1f} ms, \"
      f\"p99 {q['99.000000'] / 1e6:5.1f} ms\")"
    stop "${PIDS[@]}"
}

for _ in $(seq "$ROUNDS"); do
    case_run default "$NEW_SF"
    case_run placed-writes "$NEW_SF" --placed-writes
    if [[ -n "${OLD_SF:-}" ]]; then
        case_run "placed-writes (OLD_SF)" "$OLD_SF" --placed-writes
    fi
done
