#!/usr/bin/env bash
# The project's test command: unit and simulator tests (cargo), then the
# real-process tests (tests/, pytest) against the release binary.
#
#     bash scripts/test.sh            # everything
#     bash scripts/test.sh -k nbdinfo # extra arguments go to pytest
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

if [[ -d "${HOME:-/root}/.cargo/bin" ]]; then
    PATH="${HOME:-/root}/.cargo/bin:$PATH"
fi
# losetup, mkfs.ext4, fsck.ext4 live in sbin.
PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"
export PATH

# Each stage's heading says how long the run has taken so far, so a slow stage shows in CI's log.
stage() { echo "== [$((SECONDS / 60))m$((SECONDS % 60))s] $*"; }

stage "installing test dependencies"
bash scripts/install-test-deps.sh

stage "cargo fmt --check"
cargo fmt --all --check
rustfmt --check --edition 2021 fuzz/fuzz_targets/*.rs

stage "cargo build --release --workspace --all-targets"
# The product and every test binary in one build. The starfish binary is the same as `cargo
# build --release` makes: dev-dependencies change no feature of what it links.
cargo build --release --workspace --all-targets

stage "cargo clippy --workspace --all-targets -- -D warnings"
# After the build, in its profile. Run first, clippy built and ran the dependencies' build
# scripts (jemalloc's C build among them: 100 s here), and the build then did them all again;
# run after it, clippy takes the build's (docs/testing.md: 3m09s, 2m59s and 3m12s first in CI,
# 1m06s after a fresh build).
cargo clippy --release --workspace --all-targets -- -D warnings

stage "cargo test --release --workspace (the simulator's CI runs and fuzzing: in the background below)"
cargo test --release --workspace --exclude sim
# The test binaries of the simulator and the store as the workspace's build made them, run
# directly: `cargo test -p sim` (or `-p store`) resolves its dependencies' features on its own
# (syn's, under thiserror's derive) and built proto, the core and the crate again (45 s in CI
# for the simulator, 38 s for the store). The simulator's unit tests run now; its CI runs
# (crates/sim/tests/ci.rs) in the background below, with no cargo lock held.
test_binaries="$(cargo test --release --workspace --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        for package in ("sim", "store"):
            if m["manifest_path"].endswith(f"crates/{package}/Cargo.toml"):
                print(package, m["target"]["name"], m["target"]["kind"][0], m["executable"])')"
sim_ci=""
sim_unit=0
store_lib=""
while read -r package name kind executable; do
    if [[ "$package" == store ]]; then
        [[ "$kind" == lib ]] && store_lib="$executable"
    elif [[ "$name" == ci && "$kind" == test ]]; then
        sim_ci="$executable"
    elif [[ -n "$executable" ]]; then
        echo "     Running the simulator's $kind $name tests ($executable)"
        (cd crates/sim && "$executable")
        sim_unit=$((sim_unit + 1))
    fi
done <<<"$test_binaries"
if [[ $sim_unit -eq 0 ]]; then
    echo "test: the simulator's unit test binaries were not built" >&2
    exit 1
fi
if [[ ! -x "$sim_ci" ]]; then
    echo "test: the simulator's CI test binary was not built" >&2
    exit 1
fi
# The store's tests again with their files in memory: on tmpfs the store takes other paths (data
# files written through a mapping, no log sync, its own read rules). Seconds.
if [[ "$(stat -f -c %T /dev/shm 2>/dev/null)" == tmpfs ]]; then
    stage "the store's tests, files on tmpfs (TMPDIR=/dev/shm)"
    if [[ ! -x "$store_lib" ]]; then
        echo "test: the store's unit test binary was not built" >&2
        exit 1
    fi
    (cd crates/store && TMPDIR=/dev/shm "$store_lib")
else
    echo "     /dev/shm is not a tmpfs here: the store's tests ran on $(stat -f -c %T "${TMPDIR:-/tmp}") only"
fi

# The simulator's CI runs and the fuzz targets need nothing of the real-process suite and check
# no clock (simulated time; libFuzzer's -max_total_time bounds executions, not results), and the
# real-process suite leaves about half of two CPUs idle. So they run beside it at nice 19: they
# take the idle CPU and yield it the moment a test's process wakes. Their output is printed when
# they are done.
target_dir="${CARGO_TARGET_DIR:-$repo/target}"
export STARFISH_BIN="${STARFISH_BIN:-$target_dir/release/starfish}"
mkdir -p "$target_dir"
background_log="$target_dir/test-background.log"
# Wall time per fuzz target: beside pytest a target runs between a seventh and all of the
# inputs it runs alone in the same time (docs/testing.md), so it gets twice the 8 s it had
# alone.
fuzz_seconds=16
set -m # the background stage gets a process group of its own, so it can be stopped as a whole
(
    set +e
    # The fuzz targets first: each runs for a fixed wall time on one core, best spent beside
    # pytest, while the simulator's runs (a fixed amount of work on two threads) can use both
    # cores once pytest is done.
    stage "fuzz targets, $fuzz_seconds s each (bash scripts/fuzz.sh SECONDS for other lengths)"
    nice -n 19 bash scripts/fuzz.sh "$fuzz_seconds"
    fuzz_status=$?
    stage "simulator CI runs ($sim_ci)"
    (cd crates/sim && nice -n 19 "$sim_ci")
    sim_status=$?
    stage "fuzz targets: status $fuzz_status; simulator CI runs: status $sim_status"
    [[ $sim_status -eq 0 && $fuzz_status -eq 0 ]]
) >"$background_log" 2>&1 &
background=$!
set +m
# An interrupted or failed run stops the background stage too.
trap 'kill -- "-$background" 2>/dev/null || true' EXIT
trap 'exit 130' INT TERM
stage "background (pid $background, log $background_log): fuzz targets, then the simulator CI runs"

stage "pytest tests/ (STARFISH_BIN=$STARFISH_BIN)"
# Debian's python3 has the libnbd bindings (module `nbd`). Each test has its
# own time limit; this bounds the whole run, with SIGINT first so pytest still
# tears down (stops processes, unmounts, detaches loop devices).
# Two workers (pytest-xdist): the tests spend most of their time waiting on processes (about a
# quarter of two CPUs busy with one worker), so two at once halve the stage. Each worker draws
# ports from its own range (harness.free_port). STARFISH_TEST_WORKERS=0 runs them one by one.
status=0
timeout -s INT -k 60 "${STARFISH_TEST_TIMEOUT:-1200}" \
    /usr/bin/python3 -m pytest -q -p no:cacheprovider -rfEs --durations=15 \
    -n "${STARFISH_TEST_WORKERS:-2}" tests/ "$@" || status=$?
stage "pytest done (status $status); waiting for the background stage"
if [[ $status -eq 5 ]]; then
    echo "pytest collected no tests" >&2
fi
background_status=0
wait "$background" || background_status=$?
cat "$background_log"
stage "done (pytest status $status, fuzzing and simulator status $background_status)"
if [[ $status -eq 0 ]]; then
    status=$background_status
fi
exit $status
