#!/usr/bin/env bash
# A quick look at the data path's speed and CPU cost on this machine (issue 16): three
# elements with their data on tmpfs and a host element on loopback (Q=2, one 1 GiB volume),
# then fio's nbd engine: 4 KiB random writes at QD1 and QD16, 4 KiB random reads at QD16,
# 1 MiB sequential writes at QD16 (RUNTIME s each, default 8), and the CPU time (user+system,
# from /proc) the host element and the elements spent per 4 KiB write at QD16.
#   bash scripts/perf-quick.sh                       # target/release/starfish
#   SF=/path/a SFE=/path/b bash scripts/perf-quick.sh  # host element from a, elements from b
# The machine is shared and noisy: compare builds by alternating runs, never across days.
set -euo pipefail
cd "$(dirname "$0")/.."
SF=${SF:-$PWD/target/release/starfish}
SFE=${SFE:-$SF}
RUNTIME=${RUNTIME:-8}
BASE=${BASE_PORT:-10960}
DIR=$(mktemp -d /dev/shm/starfish-perf-quick.XXXXXX)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do while kill -0 "$p" 2>/dev/null; do sleep 0.1; done; done
    rm -rf "$DIR"
}
trap cleanup EXIT
for i in 1 2 3; do
    "$SFE" element --listen "127.0.0.1:$((BASE + i))" --data "$DIR/e$i" >"$DIR/e$i.log" 2>&1 &
    PIDS+=($!)
done
sleep 1
"$SF" host --nbd "127.0.0.1:$BASE" --admin "127.0.0.1:$((BASE + 4))" --element "local=127.0.0.1:$((BASE + 1))" \
    --element "near=127.0.0.1:$((BASE + 2))" --element "far=127.0.0.1:$((BASE + 3))" --quorum 2 --volume vol0:1GiB \
    >"$DIR/host.log" 2>&1 &
HOST=$!
PIDS+=("$HOST")
for _ in $(seq 100); do "$SF" status --admin "127.0.0.1:$((BASE + 4))" >/dev/null 2>&1 && break; sleep 0.1; done
cpu() { local t=0 p; for p in "$@"; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done; echo "$t"; }
job() { # rw bs qd: one fio run; prints "rw bs qdN: IOPS (mean µs) MB/s", the I/Os done to $DIR/ios
    fio --name=quick --ioengine=nbd --uri="nbd://127.0.0.1:$BASE/vol0" --rw="$1" --bs="$2" --iodepth="$3" \
        --size=1g --time_based --runtime="$RUNTIME" --output-format=json 2>/dev/null |
        /usr/bin/python3 -c "
import json, sys
text = sys.stdin.read(); job = json.loads(text[text.index('{'):])['jobs'][0]
j = job['write'] if 'write' in '$1' else job['read']
print(f\"$1 $2 qd$3: {j['iops']:.0f} IOPS ({j['lat_ns']['mean'] / 1000:.0f} µs), {j['bw'] * 1024 / 1e6:.0f} MB/s\")
open('$DIR/ios', 'w').write(str(j['total_ios']))"
}
job randwrite 4k 1
h0=$(cpu "$HOST"); e0=$(cpu "${PIDS[@]:0:3}")
job randwrite 4k 16
h1=$(cpu "$HOST"); e1=$(cpu "${PIDS[@]:0:3}")
ios=$(cat "$DIR/ios")
tick_us=$((1000000 / $(getconf CLK_TCK)))
if [[ "$ios" =~ ^[0-9]+$ ]] && ((ios > 0)); then
    echo "CPU per 4 KiB write at QD16: host element $(((h1 - h0) * tick_us / ios)) µs, elements $(((e1 - e0) * tick_us / ios)) µs"
fi
job randread 4k 16
job write 1m 16
