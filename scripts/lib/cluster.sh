# Sourced by the measurement scripts (perf-quick.sh, durable-floor.sh, first-fill.sh, fill-beside-writes.sh,
# ab-jobs.sh): the processes they start, a StarFish cluster on loopback, the processes' CPU time
# and page faults from /proc, and their cleanup. The sourcing script sets DIR (scratch
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
