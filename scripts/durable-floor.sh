#!/usr/bin/env bash
# What the durable cluster asks of the disk, next to what the disk does alone, in one run
# (issue 16; figures in docs/benchmarks.md). On the disk that holds DATA (default /var/tmp):
#   1. fio alone, O_DIRECT, QD16: 4 KiB random writes (RUNTIME s) and 1 MiB sequential writes
#      (half as long) into a 2 GiB file: what the disk does without us;
#   2. three elements and a host element on loopback (Q=2, one 1 GiB volume filled once with
#      1 MiB writes, as the peer suite's prefill does), then fio's nbd engine: 4 KiB random
#      writes QD16 (RUNTIME s) and 1 MiB sequential writes QD16 (half as long). For each, from
#      /proc/diskstats and /proc/stat over the job: device writes and bytes per client write,
#      device writes and flushes a second, and how busy both CPUs were.
#   bash scripts/durable-floor.sh              # DATA=/var/tmp RUNTIME=20 BASE_PORT=10980
# Builds nothing: uses target/release/starfish (or SF=). The machine is shared and noisy: read
# the ratios within one run.
set -euo pipefail
cd "$(dirname "$0")/.."
SF=${SF:-$PWD/target/release/starfish}
SFE=$SF
DATA=${DATA:-/var/tmp}
RUNTIME=${RUNTIME:-20}
BASE=${BASE_PORT:-10980}
DIR=$(mktemp -d "$DATA/starfish-durable-floor.XXXXXX")
source scripts/lib/cluster.sh
trap cleanup EXIT

source=$(df --output=source "$DATA" | tail -1)
device=$(basename "$(readlink -f "$source")")
if ! awk -v d="$device" '$3 == d {found = 1} END {exit !found}' /proc/diskstats; then
    echo "cannot find the block device of $DATA ($source) in /proc/diskstats" >&2
    exit 2
fi
disk() { awk -v d="$device" '$3 == d {print $8, $10, $20}' /proc/diskstats; } # writes, sectors, flushes
busy() { awk '/^cpu / {print $2 + $3 + $4 + $7 + $8, $2 + $3 + $4 + $5 + $6 + $7 + $8}' /proc/stat; }
figure() { # fio-json-file: prints the write side's "IOPS MB/s I/Os seconds"
    /usr/bin/python3 -c "
import json
text = open('$1').read(); j = json.loads(text[text.index('{'):])['jobs'][0]['write']
print(round(j['iops']), round(j['bw'] * 1024 / 1e6), j['total_ios'], j['runtime'] / 1000)"
}
measure() { # label bytes-per-client-write fio-args...: runs fio, prints the job and the disk's share
    local label=$1 bytes=$2 w0 s0 f0 w1 s1 f1 c0 t0 c1 t1 iops mbps ios runtime
    shift 2
    read -r w0 s0 f0 < <(disk)
    read -r c0 t0 < <(busy)
    fio --output-format=json "$@" >"$DIR/fio.json" 2>/dev/null
    read -r w1 s1 f1 < <(disk)
    read -r c1 t1 < <(busy)
    read -r iops mbps ios runtime < <(figure "$DIR/fio.json")
    /usr/bin/python3 -c "
ios, runtime = $ios, $runtime
print(f'$label: $iops IOPS, $mbps MB/s')
if ios:
    print(f'  device writes per client write {($w1 - $w0) / ios:.2f}, device bytes per client byte '
          f'{($s1 - $s0) * 512 / ios / $bytes:.2f}, device writes {($w1 - $w0) / runtime:.0f}/s, '
          f'device MB/s {($s1 - $s0) * 512 / runtime / 1e6:.0f}, flushes {($f1 - $f0) / runtime:.0f}/s, '
          f'CPU busy {100 * ($c1 - $c0) / max($t1 - $t0, 1):.0f} %')"
}

echo "disk: $device (holds $DATA)"
fallocate -l 2G "$DIR/alone.img"
common=(--name=alone "--filename=$DIR/alone.img" --ioengine=libaio --direct=1 --iodepth=16 --size=2g --time_based)
measure "the disk alone, O_DIRECT 4 KiB random writes QD16" 4096 "${common[@]}" --rw=randwrite --bs=4k "--runtime=$RUNTIME"
measure "the disk alone, O_DIRECT 1 MiB sequential writes QD16" 1048576 "${common[@]}" --rw=write --bs=1m \
    "--runtime=$(((RUNTIME + 1) / 2))"
rm -f "$DIR/alone.img"

start_cluster
nbd=(--name=starfish --ioengine=nbd "--uri=nbd://127.0.0.1:$BASE/vol0" --size=1g)
fio "${nbd[@]}" --rw=write --bs=1m --iodepth=16 >/dev/null 2>&1
sleep 2
measure "StarFish durable, 4 KiB random writes QD16" 4096 "${nbd[@]}" --rw=randwrite --bs=4k --iodepth=16 \
    --time_based "--runtime=$RUNTIME"
measure "StarFish durable, 1 MiB sequential writes QD16" 1048576 "${nbd[@]}" --rw=write --bs=1m --iodepth=16 \
    --time_based "--runtime=$(((RUNTIME + 1) / 2))"
