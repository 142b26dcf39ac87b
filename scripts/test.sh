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

stage "cargo clippy --workspace --all-targets -- -D warnings"
# Release profile: shares its dependency builds with the build and tests below.
cargo clippy --release --workspace --all-targets -- -D warnings

stage "cargo build --release --workspace"
cargo build --release --workspace

stage "cargo test --release --workspace"
cargo test --release --workspace

stage "fuzz targets, 8 s each (bash scripts/fuzz.sh SECONDS for longer runs)"
bash scripts/fuzz.sh 8

target_dir="${CARGO_TARGET_DIR:-$repo/target}"
export STARFISH_BIN="${STARFISH_BIN:-$target_dir/release/starfish}"

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
stage "done (pytest status $status)"
if [[ $status -eq 5 ]]; then
    echo "pytest collected no tests" >&2
fi
exit $status
