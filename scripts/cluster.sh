#!/usr/bin/env bash
# A local three-node RabbitMQ cluster for the cluster test and
# `scripts/bench.sh --cluster` (#26, contract §6a), made of the machine's own
# RabbitMQ (Debian's rabbitmq-server) and leaving the machine's node
# (rabbit@localhost on 5672) alone: each node has its own name, AMQP port,
# distribution port, configuration, data and logs under one directory, and
# no plugins (so nothing clashes with the machine node's 15672).
#
#   scripts/cluster.sh up            # start sas1..sas3@localhost, join them, wait
#   scripts/cluster.sh urls          # amqp://guest:guest@127.0.0.1:5701/%2f,… for broker.url
#   scripts/cluster.sh status        # each node: port, running or not, as the cluster sees it
#   scripts/cluster.sh leader QUEUE  # the node holding a quorum queue's leader
#   scripts/cluster.sh kill NODE     # SIGKILL a node's Erlang VM (NODE: 1, sas1 or sas1@localhost)
#   scripts/cluster.sh start NODE    # start it again; waits until it is back in the cluster
#   scripts/cluster.sh down          # stop every node and remove the directory
#
# Settings (environment): SAS_CLUSTER_DIR (/tmp/sas-cluster),
# SAS_CLUSTER_AMQP_BASE (5700: nodes on 5701–5703), SAS_CLUSTER_DIST_BASE
# (25700: Erlang distribution on 25701–25703), SAS_CLUSTER_TIMEOUT (90
# seconds for a node to come up or go). `up` and `down` are idempotent.
# Whatever does not come up within the bound fails the command with one line.
#
# The nodes share the machine's epmd (it maps names to ports, so that is
# harmless) but not its Erlang cookie: HOME points at the cluster's
# directory, whose .erlang.cookie both the nodes and this script's CLI
# calls read. The nodes run as the calling user.
set -euo pipefail

dir="${SAS_CLUSTER_DIR:-/tmp/sas-cluster}"
amqp_base="${SAS_CLUSTER_AMQP_BASE:-5700}"
dist_base="${SAS_CLUSTER_DIST_BASE:-25700}"
timeout="${SAS_CLUSTER_TIMEOUT:-90}"
rabbit_bin="${RABBITMQ_BIN:-/usr/lib/rabbitmq/bin}"
host=localhost
all=(1 2 3)

say() { echo "scripts/cluster.sh: $*" >&2; }
die() {
    say "$*"
    exit 1
}

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit "${1:-0}"
}

command -v jq >/dev/null 2>&1 || die "jq is missing: install it (apt-get install -y jq)"
if [ ! -x "$rabbit_bin/rabbitmq-server" ] || [ ! -x "$rabbit_bin/rabbitmqctl" ]; then
    die "RabbitMQ's binaries are not in $rabbit_bin: install Debian's rabbitmq-server (apt-get install -y rabbitmq-server) or set RABBITMQ_BIN"
fi

node_name() { echo "sas$1@$host"; }
amqp_port() { echo $((amqp_base + $1)); }
node_dir() { echo "$dir/sas$1"; }

# A node's number from 1, sas1 or sas1@localhost.
node_number() {
    local n="${1%@*}"
    n="${n#sas}"
    case "$n" in
    1 | 2 | 3) echo "$n" ;;
    *) die "no node '$1' (1, 2, 3, sasN or sasN@$host)" ;;
    esac
}

# The environment RabbitMQ's scripts read for node $1 (the server and the
# CLI alike). Our own env file, configuration and plugin list, so that
# nothing of the machine node's (/etc/rabbitmq: its node name, its 5672
# listener) applies.
node_env() {
    local d
    d="$(node_dir "$1")"
    export HOME="$dir"
    export RABBITMQ_CONF_ENV_FILE="$dir/rabbitmq-env.conf"
    export RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins"
    export RABBITMQ_NODENAME
    RABBITMQ_NODENAME="$(node_name "$1")"
    export RABBITMQ_CONFIG_FILE="$d/rabbitmq.conf"
    export RABBITMQ_ADVANCED_CONFIG_FILE="$d/advanced.config"
    export RABBITMQ_MNESIA_BASE="$d/mnesia"
    export RABBITMQ_LOG_BASE="$d/log"
    export RABBITMQ_PID_FILE="$d/pid"
    export RABBITMQ_DIST_PORT
    RABBITMQ_DIST_PORT="$((dist_base + $1))"
    # Distribution on loopback only, as the machine's node does.
    export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
}

# rabbitmqctl (or another CLI in $rabbit_bin, as $2) against node $1.
ctl() {
    local n="$1" tool="$2"
    shift 2
    (
        node_env "$n"
        "$rabbit_bin/$tool" -q -n "$(node_name "$n")" "$@"
    )
}

# The directory, the cookie and each node's configuration: kept if present.
prepare() {
    mkdir -p "$dir"
    if [ ! -s "$dir/.erlang.cookie" ]; then
        (umask 077 && head -c 30 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$dir/.erlang.cookie")
    fi
    chmod 400 "$dir/.erlang.cookie"
    : >"$dir/rabbitmq-env.conf"
    echo '[].' >"$dir/enabled_plugins"
    local n d
    for n in "${all[@]}"; do
        d="$(node_dir "$n")"
        mkdir -p "$d/mnesia" "$d/log"
        cat >"$d/rabbitmq.conf" <<EOF
listeners.tcp.local = 127.0.0.1:$(amqp_port "$n")
# guest logs in from loopback only, which is where every client is.
loopback_users.guest = true
# What sas relies on (contract §1b; deploy/rabbitmq/rabbitmq.conf).
frame_max = 16384
max_message_size = 16777216
EOF
    done
}

pid_of() {
    local file
    file="$(node_dir "$1")/pid"
    [ -s "$file" ] && cat "$file"
}

# Whether node $1's VM is alive (by its pid file).
alive() {
    local pid
    pid="$(pid_of "$1")" || return 1
    kill -0 "$pid" 2>/dev/null
}

# The cluster's running nodes as node $1 sees them, one per line; fails if
# node $1 does not answer.
running_nodes() {
    ctl "$1" rabbitmqctl cluster_status --formatter json 2>/dev/null | jq -r '.running_nodes[]'
}

# Whether the RabbitMQ application runs on node $1.
running() {
    alive "$1" && running_nodes "$1" | grep -qx "$(node_name "$1")"
}

# Waits until `$2...` (a command) succeeds, or fails with `$1`.
wait_for() {
    local what="$1" deadline=$((SECONDS + timeout))
    shift
    until "$@"; do
        [ "$SECONDS" -lt "$deadline" ] || die "$what not within ${timeout}s (logs in $dir)"
        sleep 0.5
    done
}

start_node() {
    local n="$1" d
    d="$(node_dir "$n")"
    if alive "$n"; then
        wait_for "$(node_name "$n") running" running "$n"
        return
    fi
    rm -f "$d/pid"
    (
        node_env "$n"
        cd "$d"
        exec setsid "$rabbit_bin/rabbitmq-server" </dev/null >>"$d/log/console.log" 2>&1
    ) &
    local job=$!
    # The pid file appears once the VM is up; a VM that exits early (a port
    # in use, a bad configuration) ends the wait at once.
    local deadline=$((SECONDS + timeout))
    until running "$n"; do
        if ! kill -0 "$job" 2>/dev/null; then
            die "$(node_name "$n") exited while starting; see $d/log/console.log: $(tail -n 3 "$d/log/console.log" | tr '\n' ' ')"
        fi
        [ "$SECONDS" -lt "$deadline" ] || die "$(node_name "$n") not running within ${timeout}s; see $d/log"
        sleep 0.5
    done
}

# Whether node $1 is a member of node 1's cluster.
member() {
    ctl 1 rabbitmqctl cluster_status --formatter json 2>/dev/null |
        jq -r '.disk_nodes[]' | grep -qx "$(node_name "$1")"
}

# Whether every node runs in one cluster, as node $1 sees it.
all_running_from() {
    local seen n
    seen="$(running_nodes "$1")" || return 1
    for n in "${all[@]}"; do
        grep -qx "$(node_name "$n")" <<<"$seen" || return 1
    done
}

cmd_up() {
    prepare
    local n
    for n in "${all[@]}"; do
        start_node "$n"
    done
    for n in 2 3; do
        if ! member "$n"; then
            # The CLI's chatter (tables of the joining node) goes to a log.
            {
                ctl "$n" rabbitmqctl stop_app &&
                    ctl "$n" rabbitmqctl join_cluster "$(node_name 1)" &&
                    ctl "$n" rabbitmqctl start_app
            } >>"$dir/join.log" 2>&1 ||
                die "$(node_name "$n") could not join $(node_name 1); see $dir/join.log and $(node_dir "$n")/log"
        fi
    done
    wait_for "three nodes running in one cluster" all_running_from 1
    say "up: $(cmd_urls)"
}

cmd_down() {
    local n pid
    for n in "${all[@]}"; do
        if alive "$n"; then
            pid="$(pid_of "$n")"
            # The data is thrown away, so there is nothing to stop cleanly.
            kill -KILL "$pid" 2>/dev/null || true
            wait_for "$(node_name "$n") gone" gone "$pid"
        fi
    done
    rm -rf "$dir"
}

gone() { ! kill -0 "$1" 2>/dev/null; }

cmd_kill() {
    local n pid
    n="$(node_number "$1")"
    alive "$n" || die "$(node_name "$n") is not running"
    pid="$(pid_of "$n")"
    kill -KILL "$pid"
    wait_for "$(node_name "$n") gone after SIGKILL" gone "$pid"
    say "killed $(node_name "$n") (pid $pid)"
}

# Whether node $1 runs and some other running node counts it in.
back_in_cluster() {
    local n="$1" other
    running "$n" || return 1
    for other in "${all[@]}"; do
        [ "$other" = "$n" ] && continue
        if running_nodes "$other" | grep -qx "$(node_name "$n")"; then
            return 0
        fi
    done
    return 1
}

cmd_start() {
    local n
    n="$(node_number "$1")"
    [ -d "$(node_dir "$n")/mnesia" ] || die "no cluster in $dir: run 'scripts/cluster.sh up' first"
    start_node "$n"
    wait_for "$(node_name "$n") back in the cluster" back_in_cluster "$n"
    say "started $(node_name "$n")"
}

cmd_status() {
    local n state
    for n in "${all[@]}"; do
        if running "$n"; then
            state="running; sees $(running_nodes "$n" | sort | paste -sd ' ')"
        elif alive "$n"; then
            state="VM up, RabbitMQ not running"
        else
            state="down"
        fi
        echo "$(node_name "$n") amqp 127.0.0.1:$(amqp_port "$n"): $state"
    done
}

cmd_urls() {
    local n urls=()
    for n in "${all[@]}"; do
        urls+=("amqp://guest:guest@127.0.0.1:$(amqp_port "$n")/%2f")
    done
    (
        IFS=,
        echo "${urls[*]}"
    )
}

cmd_leader() {
    local queue="$1" n
    for n in "${all[@]}"; do
        if running "$n"; then
            local leader
            leader="$(ctl "$n" rabbitmqctl list_queues name leader --no-table-headers 2>/dev/null |
                awk -v q="$queue" '$1 == q { print $2 }')"
            [ -n "$leader" ] || die "no quorum queue $queue with a leader"
            echo "$leader"
            return
        fi
    done
    die "no node is running"
}

case "${1:-}" in
up) cmd_up ;;
down) cmd_down ;;
kill) [ $# -eq 2 ] || usage 2; cmd_kill "$2" ;;
start) [ $# -eq 2 ] || usage 2; cmd_start "$2" ;;
status) cmd_status ;;
urls) cmd_urls ;;
leader) [ $# -eq 2 ] || usage 2; cmd_leader "$2" ;;
-h | --help | help) usage 0 ;;
*) usage 2 ;;
esac
