#!/usr/bin/env bash
# System calls, context switches and CPU time per I/O, per process, of StarFish (elements on
# tmpfs, as perf-quick.sh starts it) and of QEMU quorum over three nbdkit memory children, one
# fio job each (issue 16: where the CPU of a replicated write goes on this machine). `perf stat`
# counts each process over RUNTIME s of fio (default 8) after a 2 s warm-up:
#   bash scripts/per-op-counts.sh                     # 4 KiB random writes at QD1
#   QD=16 bash scripts/per-op-counts.sh
#   RW=randread BS=4k QD=16 SYSTEMS=starfish bash scripts/per-op-counts.sh
#   EVENTS=context-switches,task-clock bash scripts/per-op-counts.sh
# Counting system calls (the raw_syscalls tracepoint) slows every call: compare the counts, and
# take CPU time and IOPS from a run without it (EVENTS above) or from perf-quick.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
SF=${SF:-$PWD/target/release/starfish}
SFE=${SFE:-$SF}
SYSTEMS=${SYSTEMS:-starfish qemu-quorum}
RUNTIME=${RUNTIME:-8}
QD=${QD:-1}
RW=${RW:-randwrite}
BS=${BS:-4k}
EVENTS=${EVENTS:-raw_syscalls:sys_enter,context-switches,task-clock}
BASE=${BASE_PORT:-11960}
DIR=$(mktemp -d /dev/shm/starfish-per-op.XXXXXX)
source scripts/lib/cluster.sh
trap cleanup EXIT
fio_job() { # uri seconds [fio output options...]
    fio --name=count --ioengine=nbd --uri="$1" --rw="$RW" --bs="$BS" --iodepth="$QD" --size=1g --time_based \
        --runtime="$2" "${@:3}"
}
measure() { # label uri name=pid...: counts per I/O of each process and of all of them
    local label=$1 uri=$2 named counters=()
    shift 2
    fio_job "$uri" 2 >/dev/null 2>&1
    for named in "$@"; do
        perf stat -e "$EVENTS" -p "${named#*=}" -x, -o "$DIR/stat.${named%=*}" -- sleep $((RUNTIME + 1)) &
        counters+=($!)
    done
    sleep 0.5
    fio_job "$uri" "$RUNTIME" --output-format=json 2>/dev/null >"$DIR/fio.json"
    wait "${counters[@]}"
    /usr/bin/python3 - "$DIR" "$label" "$@" <<'PY'
import json, sys
directory, label, named = sys.argv[1], sys.argv[2], sys.argv[3:]
text = open(f"{directory}/fio.json").read()
job = json.loads(text[text.index("{"):])["jobs"][0]
kind = "write" if job["write"]["total_ios"] else "read"
ios = job[kind]["total_ios"]
print(f"{label}: {job[kind]['iops']:.0f} IOPS (mean {job[kind]['lat_ns']['mean'] / 1000:.0f} µs), {ios} I/Os")
def per_op(event, value):  # task-clock is in ms: µs per I/O
    return value / ios * (1000 if event == "task-clock" else 1)
total = {}
for name in [n.split("=")[0] for n in named]:
    counts = {}
    for line in open(f"{directory}/stat.{name}"):
        fields = line.strip().split(",")
        if line.startswith("#") or len(fields) < 3:
            continue
        try:
            counts[fields[2]] = float(fields[0])
        except ValueError:
            pass  # <not counted>
    for event, value in counts.items():
        total[event] = total.get(event, 0) + value
    print(f"  {name:7} " + "  ".join(f"{e.split(':')[-1]}/op {per_op(e, v):7.2f}" for e, v in counts.items()))
print(f"  {'all':7} " + "  ".join(f"{e.split(':')[-1]}/op {per_op(e, v):7.2f}" for e, v in total.items()))
PY
}
for system in $SYSTEMS; do
    case $system in
        starfish)
            start_cluster
            measure "starfish (elements on tmpfs), $RW $BS QD$QD" "nbd://127.0.0.1:$BASE/vol0" he="$HOST" \
                local="${REPLICAS[0]}" near="${REPLICAS[1]}" far="${REPLICAS[2]}"
            stop "$HOST" "${REPLICAS[@]}"
            rm -rf "$DIR"/e?
            ;;
        qemu-quorum)
            start_quorum
            measure "qemu-quorum (best-fifo), $RW $BS QD$QD" "nbd://127.0.0.1:$((BASE + 10))" qemu="$QUORUM_HEAD" \
                nbdkit1="${QUORUM_REPLICAS[0]}" nbdkit2="${QUORUM_REPLICAS[1]}" nbdkit3="${QUORUM_REPLICAS[2]}"
            stop "$QUORUM_HEAD" "${QUORUM_REPLICAS[@]}"
            ;;
        *) echo "unknown system $system (starfish, qemu-quorum)" >&2; exit 2 ;;
    esac
done
