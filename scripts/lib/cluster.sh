# Sourced by the measurement scripts (perf-quick.sh, per-op-counts.sh, durable-floor.sh, first-fill.sh,
# fill-beside-writes.sh, ab-jobs.sh): the processes they start, a StarFish cluster on loopback, QEMU
# quorum over three nbdkit children, the processes' CPU time and page faults from /proc, and their
# cleanup. The sourcing script sets DIR (scratch
# directory, removed at exit), BASE (first of five ports), SF (host element binary) and SFE
# (element binary), then calls `trap cleanup EXIT`.
PIDS=()
stop() { # pids...: TERM them and wait until each is gone
    local p
    for p in "$@"; do kill "$p" 2>/dev/null || true; done
    for p in "$@"; do while kill -0 "$p" 2>/dev/null; do sleep 0.1; done; done
}
stat_sum() { # awk-expression pids...: the expression over /proc/PID/stat's fields, summed
    local t=0 p value expr=$1
    shift
    for p in "$@"; do
        value=$(awk "{print $expr}" "/proc/$p/stat")
        t=$((t + value))
    done
    echo "$t"
}
cpu() { stat_sum '$14 + $15' "$@"; }  # user + system ticks of these processes
faults() { stat_sum '$10' "$@"; }     # their minor page faults
steal_mark() { # the whole machine's stolen and total CPU ticks so far ("steal total", /proc/stat)
    awk '/^cpu / {t = 0; for (i = 2; i <= 9; i++) t += $i; print $9, t; exit}' /proc/stat
}
steal_since() { # steal-mark: the per cent of all CPU time since that mark that the hypervisor gave
    # to other guests. This machine is shared: a job that lost more than a few per cent ran on
    # less CPU than its neighbour in the comparison, and its figures say so rather than the build.
    local s0 t0 s1 t1
    read -r s0 t0 <<<"$1"
    read -r s1 t1 < <(steal_mark)
    echo $(((s1 - s0) * 100 / (t1 - t0 > 0 ? t1 - t0 : 1)))
}
cleanup() {
    stop "${PIDS[@]}"
    rm -rf "$DIR"
}
start_cluster() { # three elements (data in $DIR/e1..3, ports BASE+1..3, more arguments from the
    # array ELEMENT_ARGS if set) and a host element (NBD on BASE, admin on BASE+4, Q=2, volume
    # vol0 of 1 GiB); sets HOST and REPLICAS; fails if the host element does not answer within 10 s
    local i _
    REPLICAS=()
    for i in 1 2 3; do
        "$SFE" element --listen "127.0.0.1:$((BASE + i))" --data "$DIR/e$i" ${ELEMENT_ARGS[@]+"${ELEMENT_ARGS[@]}"} \
            >"$DIR/e$i.log" 2>&1 &
        PIDS+=($!)
        REPLICAS+=($!)
    done
    sleep 1
    "$SF" host --nbd "127.0.0.1:$BASE" --admin "127.0.0.1:$((BASE + 4))" --element "local=127.0.0.1:$((BASE + 1))" \
        --element "near=127.0.0.1:$((BASE + 2))" --element "far=127.0.0.1:$((BASE + 3))" --quorum 2 --volume vol0:1GiB \
        >"$DIR/host.log" 2>&1 &
    HOST=$!
    PIDS+=("$HOST")
    for _ in $(seq 100); do
        "$SF" status --admin "127.0.0.1:$((BASE + 4))" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    echo "the host element did not come up; its log, $DIR/host.log:" >&2
    cat "$DIR/host.log" >&2
    return 1
}
start_quorum() { # QEMU's quorum driver as the peer suite's best-fifo variant (qemu-nbd on BASE+10,
    # vote-threshold 2, read-pattern fifo, TCP_NODELAY forced as upstream QEMU >= 8.0 does) over three
    # `nbdkit --no-sr memory 1G` children on BASE+11..13; sets QUORUM_HEAD and QUORUM_REPLICAS
    local shim=$DIR/nodelay_shim.so opts="driver=raw,file.driver=quorum,file.vote-threshold=2,file.read-pattern=fifo"
    local i port _
    QUORUM_REPLICAS=()
    gcc -shared -fPIC -O2 -o "$shim" ../shared/bench-peers/lib/nodelay_shim.c -ldl
    for i in 0 1 2; do
        port=$((BASE + 11 + i))
        nbdkit -f --no-sr -p "$port" -i 127.0.0.1 memory 1G >"$DIR/nbdkit$i.log" 2>&1 &
        PIDS+=($!)
        QUORUM_REPLICAS+=($!)
        opts="$opts,file.children.$i.driver=nbd,file.children.$i.server.type=inet,file.children.$i.server.host=127.0.0.1,file.children.$i.server.port=$port"
    done
    for i in 0 1 2; do wait_port $((BASE + 11 + i)); done
    env LD_PRELOAD="$shim" qemu-nbd -b 127.0.0.1 -p $((BASE + 10)) -t -e 8 --image-opts "$opts" >"$DIR/qemu-nbd.log" 2>&1 &
    QUORUM_HEAD=$!
    PIDS+=("$QUORUM_HEAD")
    wait_port $((BASE + 10))
}
wait_port() { # port: wait up to 10 s until something listens on 127.0.0.1:port
    local _
    for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done
    echo "port $1 did not open" >&2
    return 1
}
