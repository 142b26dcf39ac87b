#!/usr/bin/env bash
# Build StarFish and run the demo cluster: three elements behind emulated local/near/far links
# and a host element exporting vol0 over NBD. Extra arguments go to `starfish demo`
# (e.g. --duration 30). Works on a fresh Debian machine.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v cargo >/dev/null 2>&1; then
    [ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
fi
if ! command -v cargo >/dev/null 2>&1; then
    echo "cargo not found: installing Debian's Rust toolchain" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cargo rustc >/dev/null
fi
# The etcd client (automatic failover) is generated from protobuf files at build time.
if ! command -v protoc >/dev/null 2>&1 || [ ! -f /usr/include/google/protobuf/descriptor.proto ]; then
    echo "protoc not found: installing Debian's protobuf-compiler" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        protobuf-compiler libprotobuf-dev >/dev/null
fi
# The allocator, jemalloc, is built from its sources with make.
if ! command -v make >/dev/null 2>&1; then
    echo "make not found: installing Debian's make" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends make >/dev/null
fi
cargo build --release -q -p starfish
exec target/release/starfish demo "$@"
