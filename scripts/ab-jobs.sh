#!/usr/bin/env bash
# Two StarFish builds side by side on a few fio jobs, with each process's CPU (issue 16): per
# round and build, a fresh cluster (three elements, Q=2, one 1 GiB volume; data on DATA), the
# volume filled once with 1 MiB writes at QD8 (as the peer suite's prefill), then each job of
# JOBS for RUNTIME s. Builds alternate A, B, A, B, ... (ROUNDS times). Prints per job IOPS, mean
# latency, the 99th percentile of completion latency, MB/s, and the CPU (user+system from /proc) the host element and the three elements
# spent per I/O, and the per cent of the machine's CPU time the hypervisor gave to other guests
# meanwhile ("stolen"; this machine is shared: a round that lost more than a few per cent is not
# comparable with one that did not).
#   A_BIN=/path/old/starfish [B_BIN=target/release/starfish] [A_LABEL=before] [B_LABEL=after]
#   [A_SFE=... B_SFE=...] [JOBS="write 1m 1,write 1m 16"] [ROUNDS=3] [RUNTIME=6] [DATA=/dev/shm]
#   bash scripts/ab-jobs.sh
# A_SFE / B_SFE run the elements of that build with another binary (default: the build's own),
# to compare host elements only. A "binary" may be a wrapper script that sets an environment
# variable and `exec`s starfish (its PID stays the process's).
# A job is "RW BS QD" (fio's --rw, --bs, --iodepth; a BS with a '/' is fio's --bssplit, e.g.
# "randwrite 4k/90:1m/10 16": 90 % of the writes 4 KiB, 10 % 1 MiB). DATA=/var/tmp puts the
# elements on the disk (durable). Build A from another commit with
#   git worktree add /tmp/a COMMIT && (cd /tmp/a && CARGO_TARGET_DIR=/tmp/a-target cargo build --release -p starfish)
# The machine is shared and noisy: compare within one run, and look at every round, not one.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${A_BIN:?set A_BIN to the first build starfish binary}"
B_BIN=${B_BIN:-$PWD/target/release/starfish}
A_LABEL=${A_LABEL:-before} B_LABEL=${B_LABEL:-after}
JOBS=${JOBS:-write 1m 1,write 1m 16}
ROUNDS=${ROUNDS:-3} RUNTIME=${RUNTIME:-6} DATA=${DATA:-/dev/shm}
BASE=${BASE_PORT:-10980}
DIR=$(mktemp -d "$DATA/starfish-ab-jobs.XXXXXX")
source scripts/lib/cluster.sh
trap cleanup EXIT
job() { # rw bs qd: prints "IOPS mean-µs p99-µs MB/s ios"
    local sizes=("--bs=$2")
    # A mix of sizes, fio's bssplit syntax: "4k/90:1m/10" is 90 % 4 KiB, 10 % 1 MiB of the
    # writes. With fio's random map on, that mix's average write was 10-16 KB here, not the 108
    # it implies (fio shortened the large ones); with --norandommap, 104 KB.
    if [[ "$2" == */* ]]; then sizes=("--bssplit=$2" --norandommap); fi
    fio --name=ab --ioengine=nbd --uri="nbd://127.0.0.1:$BASE/vol0" --rw="$1" "${sizes[@]}" --iodepth="$3" \
        --size=1g --time_based --runtime="$RUNTIME" --output-format=json 2>/dev/null |
        python3 -c "
import json, sys
text = sys.stdin.read(); job = json.loads(text[text.index('{'):])['jobs'][0]
j = job['write'] if 'write' in '$1' else job['read']
p99 = j['clat_ns'].get('percentile', {}).get('99.000000', 0)
print(f\"{j['iops']:.0f} {j['lat_ns']['mean'] / 1000:.0f} {p99 / 1000:.0f} {j['bw'] * 1024 / 1e6:.0f} {j['total_ios']}\")"
}
tick_us=$((1000000 / $(getconf CLK_TCK)))
IFS=, read -r -a jobs <<<"$JOBS"
for round in $(seq "$ROUNDS"); do
    for build in A B; do
        if [ $build = A ]; then
            SF=$A_BIN SFE=${A_SFE:-$A_BIN} label=$A_LABEL
        else
            SF=$B_BIN SFE=${B_SFE:-$B_BIN} label=$B_LABEL
        fi
        start_cluster
        fio --name=fill --ioengine=nbd --uri="nbd://127.0.0.1:$BASE/vol0" --rw=write --bs=1m --iodepth=8 \
            --size=1g --output-format=terse >/dev/null 2>&1
        for spec in "${jobs[@]}"; do
            read -r rw bs qd <<<"$spec"
            h0=$(cpu "$HOST")
            e0=$(cpu "${REPLICAS[@]}")
            s0=$(steal_mark)
            read -r iops mean p99 mbps ios < <(job "$rw" "$bs" "$qd")
            stolen=$(steal_since "$s0")
            h1=$(cpu "$HOST")
            e1=$(cpu "${REPLICAS[@]}")
            ios=$((ios > 0 ? ios : 1))
            printf '%-8s round %d  %-9s %-3s QD%-3s %7s IOPS %7s µs (p99 %6s) %5s MB/s  CPU per I/O: host element %5d µs, elements %5d µs  (stolen %2d %%)\n' \
                "$label" "$round" "$rw" "$bs" "$qd" "$iops" "$mean" "$p99" "$mbps" \
                $(((h1 - h0) * tick_us / ios)) $(((e1 - e0) * tick_us / ios)) "$stolen"
        done
        stop "$HOST" "${REPLICAS[@]}"
        PIDS=()
        rm -rf "$DIR"/e?
    done
done
