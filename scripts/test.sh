#!/usr/bin/env bash
# Runs every test against the real Postgres (127.0.0.1:5432) and RabbitMQ
# (127.0.0.1:5672). Builds the binaries first: the end-to-end tests start them.
# Tests that restart a server (module `restarts` of the one end-to-end binary,
# tests/tests/suite) run alone, after the rest.
# Extra arguments go to nextest, e.g. `scripts/test.sh -E 'test(hanging)'`.
set -euo pipefail
cd "$(dirname "$0")/.."

profile=default
[ "${CI:-}" = "true" ] && profile=ci

cargo build --workspace --all-targets
if ! cargo nextest --version >/dev/null 2>&1; then
    echo "cargo-nextest not found: install it with 'cargo install cargo-nextest --locked'" >&2
    exit 1
fi
restarts='binary_id(sas-tests::suite) & test(/^restarts::/)'
if [ -f tests/tests/suite/restarts.rs ]; then
    cargo nextest run --workspace --profile "$profile" -E "not ($restarts)" "$@"
    cargo nextest run --workspace --profile "$profile" --test-threads 1 -E "$restarts" "$@"
else
    cargo nextest run --workspace --profile "$profile" "$@"
fi
