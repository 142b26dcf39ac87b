#!/usr/bin/env bash
# Installs what the real-process tests (tests/) need on a Debian machine.
# Idempotent: installs only what is missing, runs `apt-get update` at most once,
# and prints nothing unless something fails.
set -euo pipefail

packages=(
    qemu-utils
    libnbd-bin
    nbdkit
    nbdfuse
    fuse3
    fio
    postmark
    e2fsprogs
    xfsprogs
    btrfs-progs
    python3-pytest
    python3-pytest-xdist
    python3-libnbd
    python3-prometheus-client
    python3-websocket
    python3-pyfuse3
    python3-crcmod
    chromium
    systemd
    adduser
    util-linux
    iproute2
    etcd-server
    protobuf-compiler
    libprotobuf-dev
    make
)

missing=()
for package in "${packages[@]}"; do
    status="$(dpkg-query -W -f='${Status}' "$package" 2>/dev/null || true)"
    if [[ "$status" != "install ok installed" ]]; then
        missing+=("$package")
    fi
done

if ! command -v cargo >/dev/null 2>&1 && [[ ! -x "${HOME:-/root}/.cargo/bin/cargo" ]]; then
    missing+=(cargo rustc rust-clippy rustfmt)
else
    # The test command's gates (scripts/test.sh): Debian packages them apart from cargo.
    cargo clippy --version >/dev/null 2>&1 || missing+=(rust-clippy)
    cargo fmt --version >/dev/null 2>&1 || missing+=(rustfmt)
fi

# The Debian package's tool (scripts/package.sh), built by cargo once (about a minute).
install_cargo_deb() {
    if cargo deb --version >/dev/null 2>&1; then
        return 0
    fi
    local log
    log="$(mktemp -t install-cargo-deb.XXXXXX.log)"
    if ! cargo install cargo-deb --locked --version 3.8.0 >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        echo "install-test-deps: cargo install cargo-deb failed" >&2
        exit 1
    fi
    rm -f "$log"
}

if [[ ${#missing[@]} -eq 0 ]]; then
    install_cargo_deb
    exit 0
fi

if [[ "$(id -u)" -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1; then
        sudo=(sudo)
    else
        echo "install-test-deps: missing packages (${missing[*]}) and not root" >&2
        exit 1
    fi
else
    sudo=()
fi

log="$(mktemp -t install-test-deps.XXXXXX.log)"
trap 'rm -f "$log"' EXIT

export DEBIAN_FRONTEND=noninteractive
if ! "${sudo[@]}" apt-get update >"$log" 2>&1; then
    cat "$log" >&2
    echo "install-test-deps: apt-get update failed" >&2
    exit 1
fi
if ! "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}" >"$log" 2>&1; then
    cat "$log" >&2
    echo "install-test-deps: apt-get install ${missing[*]} failed" >&2
    exit 1
fi
install_cargo_deb
