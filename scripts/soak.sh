#!/usr/bin/env bash
# The documented soak run, on this machine, without Docker, against a local
# Postgres (127.0.0.1:5432) and RabbitMQ (127.0.0.1:5672):
#
#   1. builds the release binaries (cargo build --release --workspace),
#   2. starts remote-sim on a free port,
#   3. writes a configuration whose workflow `order` (reserve, charge, ship;
#      the first two with an undo) calls that remote-sim, with short
#      timeouts, under a fresh broker prefix and a fresh database,
#   4. runs `sas-chaos`, which starts the four services itself, sets the
#      fault mix on remote-sim, submits the orders, SIGKILLs a random service
#      every few seconds (starting it again), and prints the verdict,
#   5. cleans up: stops remote-sim, drops the database, deletes the prefix's
#      queues and the temporary files.
#
# The exit status is sas-chaos's: 0 when no order was lost, no order's
# events have a gap or two terminal states, and no effect was applied twice.
#
# Environment:
#   SOAK_ORDERS        orders to submit (default 10000)
#   SOAK_TRANSIENT     share of calls answering 503 (default 0.05)
#   SOAK_PERMANENT     share of calls answering 422 (default 0.01)
#   SOAK_KILL_EVERY    time between kills (default 3s)
#   SOAK_TIMEOUT       wait for the orders after the last is submitted (default 10m)
#   SOAK_RATE          orders per second to submit (default: as fast as confirmed)
#   SOAK_JSON=1        print the verdict as JSON instead of a table
#   SOAK_LOG_LEVEL     the services' log level (default info)
#   SOAK_KEEP=1        keep the configuration and the services' logs
#   SOAK_PG_ADMIN      a Postgres URL for dropping the database
#                      (default postgres://postgres@127.0.0.1:5432/postgres)
#   SOAK_RABBITMQCTL   how to run rabbitmqctl (default rabbitmqctl; e.g.
#                      "docker exec rabbitmq rabbitmqctl")
#   SAS__BROKER__URL   AMQP URL (default amqp://guest:guest@127.0.0.1:5672/%2f)
#   SAS_SKIP_BUILD=1   use the binaries already in target/release
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

bin_dir="${CARGO_TARGET_DIR:-$root/target}/release"
orders=${SOAK_ORDERS:-10000}
transient=${SOAK_TRANSIENT:-0.05}
permanent=${SOAK_PERMANENT:-0.01}
kill_every=${SOAK_KILL_EVERY:-3s}
timeout=${SOAK_TIMEOUT:-10m}
pg_admin=${SOAK_PG_ADMIN:-postgres://postgres@127.0.0.1:5432/postgres}
read -r -a rabbitmqctl <<<"${SOAK_RABBITMQCTL:-rabbitmqctl}"

# One id names the prefix, the database and the temporary directory.
id=$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')
prefix="soak_$id"
db="soak_$id"
work=$(mktemp -d "${TMPDIR:-/tmp}/sas-soak-$id.XXXXXX")
sim_pid=""

export SAS_CONFIG="$work/soak.toml"
export SAS__BROKER__PREFIX="$prefix"
export SAS__DATABASE__URL="${pg_admin%/*}/$db"
# sas-chaos gives each service its own port.
unset SAS__HTTP__PORT

log() {
    printf 'soak: %s\n' "$*" >&2
}

die() {
    log "error: $*"
    exit 1
}

# shellcheck disable=SC2317  # reached through the EXIT trap
stop_sim() {
    [[ -n $sim_pid ]] || return 0
    if kill -0 "$sim_pid" 2>/dev/null; then
        kill -TERM "$sim_pid" 2>/dev/null || true
        local deadline=$((SECONDS + 10))
        while kill -0 "$sim_pid" 2>/dev/null && ((SECONDS < deadline)); do
            sleep 0.2
        done
        kill -KILL "$sim_pid" 2>/dev/null || true
    fi
    wait "$sim_pid" 2>/dev/null || true
    sim_pid=""
}

# Deletes every queue named under the prefix, and the run's status queues
# (`<prefix>-…`: applications' queues may not be under the prefix).
# shellcheck disable=SC2317  # reached through the EXIT trap
delete_queues() {
    local queues q
    if ! queues=$("${rabbitmqctl[@]}" -q list_queues name --no-table-headers 2>/dev/null); then
        log "could not list the queues with ${rabbitmqctl[*]}; delete the queues named $prefix.* and $prefix-* yourself"
        return 0
    fi
    while IFS= read -r q; do
        if [[ $q == "$prefix".* || $q == "$prefix"-* ]]; then
            # </dev/null: rabbitmqctl would read the rest of the list otherwise.
            "${rabbitmqctl[@]}" -q delete_queue "$q" </dev/null >/dev/null 2>&1 ||
                log "could not delete the queue $q"
        fi
    done <<<"$queues"
}

# shellcheck disable=SC2317  # reached through the EXIT trap
cleanup() {
    local status=$?
    trap - EXIT INT TERM
    stop_sim
    log "cleaning up: database $db, queues $prefix.*"
    if command -v psql >/dev/null; then
        psql -q "$pg_admin" -c "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)" >/dev/null 2>&1 ||
            log "could not drop the database $db"
    else
        log "psql is missing; drop the database $db yourself"
    fi
    delete_queues
    if [[ ${SOAK_KEEP:-0} == 1 ]]; then
        log "kept: $work and ${TMPDIR:-/tmp}/sas-chaos-$prefix-*"
    else
        rm -rf "$work" "${TMPDIR:-/tmp}/sas-chaos-$prefix-"*
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [[ ${SAS_SKIP_BUILD:-0} != 1 ]]; then
    log "building (cargo build --release --workspace)"
    cargo build --release --workspace
fi
for bin in remote-sim submission scheduler agent supervisor sas-chaos; do
    [[ -x $bin_dir/$bin ]] || die "$bin_dir/$bin is missing; build first (or unset SAS_SKIP_BUILD)"
done

# remote-sim on a free port: it announces the address on stdout.
"$bin_dir/remote-sim" --host 127.0.0.1 --port 0 >"$work/remote-sim.out" 2>"$work/remote-sim.log" &
sim_pid=$!
sim_addr=""
deadline=$((SECONDS + 30))
while [[ -z $sim_addr ]]; do
    sim_addr=$(sed -n 's/^remote-sim listening on //p' "$work/remote-sim.out")
    if [[ -z $sim_addr ]]; then
        kill -0 "$sim_pid" 2>/dev/null || die "remote-sim exited: $(tail -n 5 "$work/remote-sim.log")"
        ((SECONDS < deadline)) || die "remote-sim did not announce its address within 30s"
        sleep 0.1
    fi
done
sim="http://$sim_addr"
log "remote-sim on $sim (pid $sim_pid)"

cat >"$SAS_CONFIG" <<EOF
# Written by scripts/soak.sh for one soak run.
[log]
level = "${SOAK_LOG_LEVEL:-info}"

[supervisor]
interval = "500ms"
max_failures = 5
retry_schedule = ["500ms", "1s", "2s"]

[shutdown]
grace = "5s"

[workflows.order]
steps = [
  { name = "reserve", agent = "inventory", timeout = "5s", compensate = "inventory-release" },
  { name = "charge",  agent = "payments",  timeout = "5s", compensate = "payments-refund" },
  { name = "ship",    agent = "shipping",  timeout = "5s" },
]

[agents.inventory]
url = "$sim/inventory/reserve"

[agents.inventory-release]
url = "$sim/inventory/release"

[agents.payments]
url = "$sim/payments/charge"

[agents.payments-refund]
url = "$sim/payments/refund"

[agents.shipping]
url = "$sim/shipping/ship"
EOF

args=(
    --spawn "$bin_dir" --sim "$sim" --workflow order
    --orders "$orders" --transient "$transient" --permanent "$permanent"
    --kill-every "$kill_every" --timeout "$timeout"
)
if [[ -n ${SOAK_RATE:-} ]]; then
    args+=(--rate "$SOAK_RATE")
fi
if [[ ${SOAK_JSON:-0} == 1 ]]; then
    args+=(--json)
fi
log "prefix $prefix, database $db, configuration $SAS_CONFIG"
log "running: sas-chaos ${args[*]}"
status=0
"$bin_dir/sas-chaos" "${args[@]}" || status=$?
exit "$status"
