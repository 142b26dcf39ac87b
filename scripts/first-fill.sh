#!/usr/bin/env bash
# A volume's first fill (issue 16; figures in docs/benchmarks.md): a fresh cluster (three
# elements with their data in DATA, a host element on loopback, Q=2, one 1 GiB volume) is
# written once end to end with 1 MiB sequential writes at QD (fio's nbd engine), as an image
# copied into a new volume is: with the elements' default settings, then with
# `--placed-writes`, alternating, ROUNDS times each, in one run. Prints the client's MB/s, the
# CPU per 1 MiB write of the host element and of the three elements (user+system from /proc),
# and the bytes the disk under DATA wrote per client byte (`-` on a file system in memory).
# With THEN="RW BS QD SECONDS" (fio's rw, block size, depth, run time), each fill is followed by
# that job over the filled volume, and a second line gives its IOPS, MB/s, CPU per operation and
# disk bytes written: what comes right after a fill. With AGE=N as well, N GiB of 1 MiB
# overwrites at QD16 come between the fill and that job (unmeasured): what comes once the store
# has aged.
#   bash scripts/first-fill.sh                       # DATA=/dev/shm QD=16 ROUNDS=1 BASE_PORT=11020
#   DATA=/var/tmp QD=1 ROUNDS=2 bash scripts/first-fill.sh
#   DATA=/var/tmp THEN="randwrite 4k 16 8" ROUNDS=2 bash scripts/first-fill.sh
#   DATA=/var/tmp AGE=2 THEN="write 1m 16 15" ROUNDS=2 bash scripts/first-fill.sh
# Builds nothing: uses target/release/starfish (or SF=). The machine is shared and noisy:
# compare within one run.
set -euo pipefail
cd "$(dirname "$0")/.."
SF=${SF:-$PWD/target/release/starfish}
SFE=$SF
DATA=${DATA:-/dev/shm}
QD=${QD:-16}
ROUNDS=${ROUNDS:-1}
BASE=${BASE_PORT:-11020}
DIR=$(mktemp -d "$DATA/starfish-first-fill.XXXXXX")
source scripts/lib/cluster.sh
trap cleanup EXIT

source=$(df --output=source "$DATA" | tail -1)
device=$(basename "$(readlink -f "$source" 2>/dev/null || echo "$source")")
sectors() { awk -v d="$device" '$3 == d {print $10; found = 1} END {if (!found) print "-"}' /proc/diskstats; }

fill() { # label element-arguments...: one fresh cluster, one fill, one line
    local label=$1 tick_us h0 e0 s0 h1 e1 s1 result mbps ios bytes per_byte=-
    shift
    ELEMENT_ARGS=("$@")
    PIDS=()
    rm -rf "${DIR:?}"/*
    start_cluster
    tick_us=$((1000000 / $(getconf CLK_TCK)))
    h0=$(cpu "$HOST") e0=$(cpu "${REPLICAS[@]}") s0=$(sectors)
    result=$(fio --name=fill --ioengine=nbd --uri="nbd://127.0.0.1:$BASE/vol0" --rw=write --bs=1m \
        --iodepth="$QD" --size=1g --output-format=json 2>/dev/null | /usr/bin/python3 -c "
import json, sys
text = sys.stdin.read(); j = json.loads(text[text.index('{'):])['jobs'][0]['write']
print(round(j['bw'] * 1024 / 1e6), j['total_ios'], j['io_bytes'])")
    h1=$(cpu "$HOST") e1=$(cpu "${REPLICAS[@]}") s1=$(sectors)
    read -r mbps ios bytes <<<"$result"
    if [[ "$s0" != - ]]; then
        per_byte=$(/usr/bin/python3 -c "print(f'{($s1 - $s0) * 512 / $bytes:.2f}')")
    fi
    printf '%-16s QD%-3s %5s MB/s  CPU per 1 MiB write: host element %5s µs, elements %5s µs  disk bytes per client byte %s\n' \
        "$label" "$QD" "$mbps" $(((h1 - h0) * tick_us / ios)) $(((e1 - e0) * tick_us / ios)) "$per_byte"
    if [[ -n "${THEN:-}" ]]; then
        if [[ -n "${AGE:-}" ]]; then
            fio --name=age --ioengine=nbd --uri="nbd://127.0.0.1:$BASE/vol0" --rw=write --bs=1m --iodepth=16 \
                --size=1g --loops="$AGE" >/dev/null 2>&1
        fi
        then_job "$label"
    fi
    stop "${PIDS[@]}"
}

then_job() { # label: the THEN job on the running cluster, one line
    local rw bs qd seconds h0 e0 s0 h1 e1 s1 iops mbps ios written=-
    read -r rw bs qd seconds <<<"$THEN"
    h0=$(cpu "$HOST") e0=$(cpu "${REPLICAS[@]}") s0=$(sectors)
    read -r iops mbps ios < <(fio --name=then --ioengine=nbd --uri="nbd://127.0.0.1:$BASE/vol0" --rw="$rw" --bs="$bs" \
        --iodepth="$qd" --size=1g --time_based --runtime="$seconds" --output-format=json 2>/dev/null | /usr/bin/python3 -c "
import json, sys
text = sys.stdin.read(); j = json.loads(text[text.index('{'):])['jobs'][0]
k = j['read'] if j['read']['total_ios'] else j['write']
print(round(k['iops']), round(k['bw'] * 1024 / 1e6), k['total_ios'])")
    h1=$(cpu "$HOST") e1=$(cpu "${REPLICAS[@]}") s1=$(sectors)
    if [[ "$s0" != - ]]; then
        written="$(((s1 - s0) * 512 / 1000000)) MB"
    fi
    printf '%-16s then %s %s QD%s: %6s IOPS %5s MB/s  CPU per op: host element %5s µs, elements %5s µs  disk written %s\n' \
        "$1" "$rw" "$bs" "$qd" "$iops" "$mbps" $(((h1 - h0) * tick_us / ios)) $(((e1 - e0) * tick_us / ios)) "$written"
}

for _ in $(seq "$ROUNDS"); do
    fill default
    fill placed-writes --placed-writes
done
