#!/usr/bin/env bash
# Benchmarks sas: builds the release binaries, then runs the harness (bench/),
# which starts remote-sim and the services against the local Postgres
# (127.0.0.1:5432) and RabbitMQ (127.0.0.1:5672) under a database and a queue
# prefix of its own, measures throughput, latency, recovery and memory, the
# machine's limit, and Celery, procrastinate and DBOS (installed into
# .bench/venv from PyPI on first use) and Restate (its server from npm into
# .bench/restate, its Rust service built into .bench/restate-target) doing the
# same work, then removes what it created.
# Prints one table; writes bench/out/latest.json and bench/out/latest.md.
#
#   scripts/bench.sh                  # the full run, ~25 minutes with every peer
#   scripts/bench.sh --quick          # a smoke run, ~10 minutes with every peer
#   scripts/bench.sh --cluster        # also: 1-step on a 3-node RabbitMQ cluster
#                                     # (scripts/cluster.sh) vs one node, quorum step queues
#   scripts/bench.sh --help           # sizes, skips and other options
#
# Measure on an otherwise idle machine: the run first waits (up to 10
# minutes) for the 1-minute load average to drop below 0.5, as after a
# build or a test run; --wait-idle 0 does not wait.
set -euo pipefail
cd "$(dirname "$0")/.."

target="${CARGO_TARGET_DIR:-target}"
# The whole workspace, as scripts/run-local.sh builds it: a -p subset unifies
# the dependencies' features otherwise and rebuilds most of the tree.
cargo build --release --workspace
wait_idle=(--wait-idle 0.5)
for arg in "$@"; do
    case "$arg" in --wait-idle | --wait-idle=*) wait_idle=() ;; esac
done
exec "$target/release/sas-bench" --bin-dir "$target/release" ${wait_idle[@]+"${wait_idle[@]}"} "$@"
