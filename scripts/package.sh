#!/usr/bin/env bash
# Builds the Debian package (cargo-deb; scripts/install-test-deps.sh installs it):
#   bash scripts/package.sh [--no-build] [--output DIR]
# prints the .deb's path. The binary is stripped (the package is about 5 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! cargo deb --version >/dev/null 2>&1; then
    echo "package: cargo-deb is missing: cargo install cargo-deb --locked (or scripts/install-test-deps.sh)" >&2
    exit 1
fi
exec cargo deb -p starfish --strip --fast "$@"
