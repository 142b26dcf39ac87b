#!/usr/bin/env bash
# Coverage-guided fuzzing of the decoders that face the network and the disk (cargo-fuzz and
# libFuzzer, on the nightly toolchain): the NBD handshake and transmission decoders, the
# element wire frames, the element log's record parser, opening a damaged data directory, and
# the admin request parser and the catalog of volumes created while running.
#
#     bash scripts/fuzz.sh                    # every target for 8 s (the test command: 16 s, beside pytest)
#     bash scripts/fuzz.sh 600                # every target for 600 s
#     bash scripts/fuzz.sh 600 wire_frame     # one target
#
# New inputs go to a temporary directory: the corpus kept in fuzz/corpus/TARGET is only read
# (add findings worth keeping with `cargo +nightly fuzz cmin TARGET`). A crash fails the run
# and leaves its input in fuzz/artifacts/TARGET (replay: cargo +nightly fuzz run TARGET FILE).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo/fuzz"
if [[ -d "${HOME:-/root}/.cargo/bin" ]]; then
    PATH="${HOME:-/root}/.cargo/bin:$PATH"
fi

seconds="${1:-8}"
shift || true
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
    targets=(admin_request catalog log_record nbd_handshake nbd_transmission wire_frame store_open)
fi

if ! cargo +nightly --version >/dev/null 2>&1; then
    echo "fuzz: SKIPPED: no nightly Rust toolchain (rustup toolchain install nightly); cargo-fuzz needs it" >&2
    exit 0
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz from the registry"
    cargo install --locked cargo-fuzz
fi

# The store_open target keeps a template store per fuzzing process (and a case copy) in
# /dev/shm or the temporary directory, named by its PID: remove those of processes gone.
remove_stale_store_dirs() {
    local dir pid
    for dir in /dev/shm/starfish-fuzz-template-* /dev/shm/starfish-fuzz-case-* \
        "${TMPDIR:-/tmp}"/starfish-fuzz-template-* "${TMPDIR:-/tmp}"/starfish-fuzz-case-*; do
        [[ -e "$dir" ]] || continue
        pid="${dir##*-}"
        kill -0 "$pid" 2>/dev/null || rm -rf "$dir"
    done
}
trap remove_stale_store_dirs EXIT

cargo +nightly fuzz build
for target in "${targets[@]}"; do mkdir -p "corpus/$target"; done
for target in "${targets[@]}"; do
    found="$(mktemp -d)"
    log="$(mktemp)"
    status=0
    cargo +nightly fuzz run "$target" "$found" "corpus/$target" -- \
        -max_total_time="$seconds" -print_final_stats=1 >"$log" 2>&1 || status=$?
    execs="$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')"
    if [[ $status -ne 0 ]]; then
        tail -40 "$log" >&2
        echo "fuzz: $target FAILED after $execs executions (input in fuzz/artifacts/$target)" >&2
        rm -rf "$found" "$log"
        exit 1
    fi
    echo "fuzz: $target: $execs executions in ${seconds} s, no crash"
    rm -rf "$found" "$log"
done
