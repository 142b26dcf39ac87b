#!/usr/bin/env bash
# A quick look at the data path's speed and CPU cost on this machine (issue 16): fio's nbd
# engine runs 4 KiB random writes at QD1 and QD16, 4 KiB random reads at QD16, 1 MiB
# sequential writes at QD16 and 1 MiB sequential reads at QD1 and QD16 (RUNTIME s each, default
# 8) against each system of SYSTEMS, one after the other in one run, and prints the CPU time
# (user+system, from /proc) the head and the replicas spent per 4 KiB write, 4 KiB read, 1 MiB
# write and 1 MiB read (and the minor page faults they took per 1 MiB write and read), and per
# job the per cent of the machine's CPU time the hypervisor gave to other guests ("stolen": this
# machine is shared, and a job that lost more than a few per cent ran on less CPU):
#   starfish     three elements with their data on tmpfs and a host element on loopback (Q=2,
#                one 1 GiB volume); head = host element, replicas = the three elements
#   qemu-quorum  QEMU's quorum driver (qemu-nbd, vote-threshold 2, read-pattern fifo, TCP_NODELAY
#                forced as upstream QEMU >= 8.0 does) over three `nbdkit --no-sr memory 1G`
#                children: the peer suite's best-fifo variant (../shared/bench-peers);
#                head = qemu-nbd, replicas = the three nbdkit processes
#   bash scripts/perf-quick.sh                         # SYSTEMS="starfish qemu-quorum"
#   SYSTEMS=starfish SF=/path/a SFE=/path/b bash scripts/perf-quick.sh
#                                                      # host element from a, elements from b
# The machine is shared and noisy: compare builds and systems within one run, never across days.
set -euo pipefail
cd "$(dirname "$0")/.."
SF=${SF:-$PWD/target/release/starfish}
SFE=${SFE:-$SF}
SYSTEMS=${SYSTEMS:-starfish qemu-quorum}
RUNTIME=${RUNTIME:-8}
BASE=${BASE_PORT:-10960}
DIR=$(mktemp -d /dev/shm/starfish-perf-quick.XXXXXX)
source scripts/lib/cluster.sh
trap cleanup EXIT
rss() { awk '/^VmRSS/ {r = $2} /^VmHWM/ {h = $2} END {printf "%d (%d)", r / 1024, h / 1024}' "/proc/$1/status"; }
job() { # uri rw bs qd: one fio run; prints "rw bs qdN: IOPS (mean µs) MB/s, stolen N %", the I/Os
    # done to $DIR/ios
    local s0
    s0=$(steal_mark)
    fio --name=quick --ioengine=nbd --uri="$1" --rw="$2" --bs="$3" --iodepth="$4" \
        --size=1g --time_based --runtime="$RUNTIME" --output-format=json 2>/dev/null |
        /usr/bin/python3 -c "
import json, sys
text = sys.stdin.read(); job = json.loads(text[text.index('{'):])['jobs'][0]
j = job['write'] if 'write' in '$2' else job['read']
print(f\"  $2 $3 qd$4: {j['iops']:.0f} IOPS ({j['lat_ns']['mean'] / 1000:.0f} µs), {j['bw'] * 1024 / 1e6:.0f} MB/s\", end='')
open('$DIR/ios', 'w').write(str(j['total_ios']))"
    echo ", stolen $(steal_since "$s0") %"
}
per_op() { # what head-before head-after replicas-before replicas-after: CPU per I/O of the last job
    local ios tick_us=$((1000000 / $(getconf CLK_TCK)))
    ios=$(cat "$DIR/ios")
    if [[ "$ios" =~ ^[0-9]+$ ]] && ((ios > 0)); then
        echo "  CPU per $1: head $((($3 - $2) * tick_us / ios)) µs, replicas $((($5 - $4) * tick_us / ios)) µs"
    fi
}
suite() { # label uri head-pid replica-pids...
    local label=$1 uri=$2 head=$3
    shift 3
    echo "$label"
    job "$uri" randwrite 4k 1
    local h0 e0
    h0=$(cpu "$head")
    e0=$(cpu "$@")
    job "$uri" randwrite 4k 16
    per_op "4 KiB write at QD16" "$h0" "$(cpu "$head")" "$e0" "$(cpu "$@")"
    h0=$(cpu "$head")
    e0=$(cpu "$@")
    job "$uri" randread 4k 16
    per_op "4 KiB read at QD16" "$h0" "$(cpu "$head")" "$e0" "$(cpu "$@")"
    h0=$(cpu "$head")
    e0=$(cpu "$@")
    local hf0 ef0 ios
    hf0=$(faults "$head")
    ef0=$(faults "$@")
    job "$uri" write 1m 16
    per_op "1 MiB write at QD16" "$h0" "$(cpu "$head")" "$e0" "$(cpu "$@")"
    ios=$(cat "$DIR/ios")
    if [[ "$ios" =~ ^[0-9]+$ ]] && ((ios > 0)); then
        echo "  minor page faults per 1 MiB write at QD16: head $((($(faults "$head") - hf0) / ios)), replicas $((($(faults "$@") - ef0) / ios))"
    fi
    local qd
    for qd in 1 16; do
        h0=$(cpu "$head")
        e0=$(cpu "$@")
        hf0=$(faults "$head")
        ef0=$(faults "$@")
        job "$uri" read 1m "$qd"
        per_op "1 MiB read at QD$qd" "$h0" "$(cpu "$head")" "$e0" "$(cpu "$@")"
        ios=$(cat "$DIR/ios")
        if [[ "$ios" =~ ^[0-9]+$ ]] && ((ios > 0)); then
            echo "  minor page faults per 1 MiB read at QD$qd: head $((($(faults "$head") - hf0) / ios)), replicas $((($(faults "$@") - ef0) / ios))"
        fi
    done
    local p replicas=()
    for p in "$@"; do replicas+=("$(rss "$p")"); done
    echo "  resident memory after the suite (peak): head $(rss "$head") MiB, replicas ${replicas[*]} MiB"
}
run_starfish() {
    start_cluster
    suite "starfish (elements on tmpfs)" "nbd://127.0.0.1:$BASE/vol0" "$HOST" "${REPLICAS[@]}"
    stop "$HOST" "${REPLICAS[@]}"
    rm -rf "$DIR"/e?
}
run_qemu_quorum() {
    start_quorum
    suite "qemu-quorum (3 nbdkit memory children, best-fifo)" "nbd://127.0.0.1:$((BASE + 10))" "$QUORUM_HEAD" \
        "${QUORUM_REPLICAS[@]}"
    stop "$QUORUM_HEAD" "${QUORUM_REPLICAS[@]}"
}
for system in $SYSTEMS; do
    case $system in
        starfish) run_starfish ;;
        qemu-quorum) run_qemu_quorum ;;
        *) echo "unknown system $system (starfish, qemu-quorum)" >&2; exit 2 ;;
    esac
done
