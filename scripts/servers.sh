#!/usr/bin/env bash
# Private servers for this checkout (#40): one Postgres and one RabbitMQ node,
# made with the machine's binaries (Debian's postgresql and rabbitmq-server)
# in a directory of their own, on ports of their own, listening on 127.0.0.1
# only. scripts/test.sh runs the tests against them, scripts/run-local.sh the
# suite (in another directory, on other ports). The machine's own servers
# (127.0.0.1:5432; rabbit@localhost on 5672, distribution 25672) are left
# alone, and need not run.
#
#   scripts/servers.sh up       # make (on first use) and start both; waits until
#                               # each accepts connections; idempotent
#   eval "$(scripts/servers.sh env)"   # the export lines below, for the tests
#   scripts/servers.sh status   # each server, running or not (exit 0 when both run,
#                               # 3 when not, 4 when there are none)
#   scripts/servers.sh stop     # stop both, keep their data (`up` starts them again)
#   scripts/servers.sh down     # stop both, remove the directory
#   scripts/servers.sh missing  # the Debian packages the servers need and the machine lacks
#   scripts/servers.sh ctl TOOL ARG...  # rabbitmqctl, rabbitmq-diagnostics... against the node
#   scripts/servers.sh pg-stop|pg-start|rabbit-stop-app|rabbit-start-app|rabbit-stop|rabbit-start
#                               # one server at a time, for the restart tests
#                               # (tests/tests/suite/restarts.rs): Postgres stops
#                               # fast; rabbit-stop stops the whole node;
#                               # rabbit-start starts the app or the node, whichever is down
#
# `env` prints, for eval:
#   SAS_SERVERS_DIR          the directory: with it set, the tests restart these
#                            servers (this script's pg-*/rabbit-* commands), not the machine's
#   SAS_TEST_DATABASE_URL    postgres://postgres@127.0.0.1:<pg port>/postgres (where the
#                            tests create and drop their databases)
#   SAS_TEST_BROKER_URL      amqp://guest:guest@127.0.0.1:<amqp port>/%2f
#   SAS_TEST_PG_BIN          the Postgres bin dir (the TLS tests' own Postgres uses it too)
#   SAS_TEST_RABBITMQ_BIN    RabbitMQ's bin dir, whose CLI the tests run with
#   SAS_TEST_RABBITMQ_NODE   -n <node> and
#   SAS_TEST_RABBITMQ_HOME   HOME=<dir>: the node's Erlang cookie is <dir>/.erlang.cookie
#
# Environment (read by the first `up`; later commands use what it recorded in
# the directory, whatever the environment says: `down` first to change them):
#   SAS_SERVERS_DIR        the directory (default <checkout>/target/sas-servers,
#                          build output that git ignores). Run as root, where the
#                          `postgres` OS user cannot reach it (a closed parent
#                          directory), /tmp/sas-servers-<checksum of it> instead
#   SAS_SERVERS_PG_PORT    Postgres's port (default 55432)
#   SAS_SERVERS_AMQP_PORT  RabbitMQ's AMQP port (default 55672)
#   SAS_SERVERS_DIST_PORT  its Erlang distribution port (default 25680; cluster.sh
#                          uses 25701-25703, the machine's node 25672)
#   SAS_SERVERS_NODE       the node's name (default sas-test@localhost)
#   SAS_SERVERS_PG_BIN     the Postgres bin dir (default: pg_config --bindir, else
#                          the newest /usr/lib/postgresql/*/bin)
#   RABBITMQ_BIN           RabbitMQ's bin dir (default /usr/lib/rabbitmq/bin)
#   SAS_SERVERS_TIMEOUT    seconds a server may take to come up or stop (default 90)
#
# Postgres: initdb --auth=trust (user postgres), max_connections 200 (the
# suite runs three tests at once, each with its services' pools; the machine's
# server has 100), fsync off (the data is thrown away, and every stop the tests
# make is clean); data in <dir>/pg/data, log <dir>/pg/postgres.log, sockets in
# <dir>/pg. Run as root, initdb and pg_ctl run as the `postgres` OS user (they
# refuse root). RabbitMQ: RabbitMQ's defaults (the tests are written against
# them), no plugins, guest logging in from loopback; its own configuration,
# HOME and .erlang.cookie, data and logs in <dir>/rabbitmq, run as the calling
# user. It shares the machine's epmd, which only maps names to ports. `down`
# removes the directory only if `up` made it (it carries a marker file).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

say() { echo "scripts/servers.sh: $*" >&2; }
die() {
    say "$*"
    exit 1
}

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit "${1:-2}"
}

# The environment must not steer the Postgres tools elsewhere: every call
# names its host, port, user and database.
unset PGHOST PGHOSTADDR PGPORT PGUSER PGDATABASE PGSERVICE PGSERVICEFILE \
    PGOPTIONS PGTARGETSESSIONATTRS PGSSLMODE PGPASSWORD PGPASSFILE PGDATA || true
export PGCONNECT_TIMEOUT=3

timeout_s="${SAS_SERVERS_TIMEOUT:-90}"
is_root() { [ "$(id -u)" -eq 0 ]; }

# The directory: as given, else the checkout's; where the postgres OS user
# cannot reach it (we are root and initdb runs as that user), one in /tmp
# named after it, so that every command finds the same one.
dir="${SAS_SERVERS_DIR:-$root/target/sas-servers}"
case "$dir" in
/*) ;;
*) dir="$PWD/$dir" ;;
esac
dir="${dir%/}"
[ -n "$dir" ] || die "SAS_SERVERS_DIR must not be /"
if is_root && id postgres >/dev/null 2>&1; then
    parent="$(dirname "$dir")"
    while [ ! -d "$parent" ]; do parent="$(dirname "$parent")"; done
    if ! (cd / && runuser -u postgres -- test -x "$parent") 2>/dev/null; then
        dir="/tmp/sas-servers-$(printf '%s' "$dir" | cksum | cut -d' ' -f1)"
    fi
fi
marker="$dir/.sas-servers"
settings="$dir/settings"
pgdir="$dir/pg"
data="$pgdir/data"
pglog="$pgdir/postgres.log"
rdir="$dir/rabbitmq"

# The settings: those `up` recorded, else the environment's.
if [ -f "$settings" ]; then
    read -r pg_port amqp_port dist_port node <"$settings"
else
    pg_port="${SAS_SERVERS_PG_PORT:-55432}"
    amqp_port="${SAS_SERVERS_AMQP_PORT:-55672}"
    dist_port="${SAS_SERVERS_DIST_PORT:-25680}"
    node="${SAS_SERVERS_NODE:-sas-test@localhost}"
fi
for p in "$pg_port" "$amqp_port" "$dist_port"; do
    if ! [[ "$p" =~ ^[0-9]+$ ]] || [ "$p" -lt 1 ] || [ "$p" -gt 65535 ]; then
        die "bad port '$p' (SAS_SERVERS_PG_PORT, SAS_SERVERS_AMQP_PORT, SAS_SERVERS_DIST_PORT)"
    fi
done
case " $pg_port $amqp_port $dist_port " in
*" 5432 "* | *" 5672 "* | *" 25672 "*) die "5432, 5672 and 25672 are the machine's servers'; pick other ports" ;;
esac
[[ "$node" == *@* ]] || die "bad node name '$node' (SAS_SERVERS_NODE=name@host)"
[ "${node%@*}" != rabbit ] || die "rabbit@… is the machine's node's name; pick another (SAS_SERVERS_NODE)"

db_url="postgres://postgres@127.0.0.1:$pg_port/postgres"
amqp_url="amqp://guest:guest@127.0.0.1:$amqp_port/%2f"

# The binaries; empty when missing (`need` says which package brings them).
pg_bin="${SAS_SERVERS_PG_BIN:-}"
if [ -z "$pg_bin" ]; then
    if command -v pg_config >/dev/null 2>&1 && [ -x "$(pg_config --bindir)/initdb" ]; then
        pg_bin="$(pg_config --bindir)"
    else
        pg_bin="$(find /usr/lib/postgresql -mindepth 2 -maxdepth 2 -name bin 2>/dev/null | sort -V | tail -n 1)"
    fi
fi
rabbit_bin="${RABBITMQ_BIN:-/usr/lib/rabbitmq/bin}"

# The Debian packages whose binaries are missing, one a line.
missing_packages() {
    local tool
    for tool in initdb pg_ctl pg_isready; do
        if [ ! -x "$pg_bin/$tool" ]; then
            echo postgresql
            break
        fi
    done
    for tool in rabbitmq-server rabbitmqctl rabbitmq-diagnostics; do
        if [ ! -x "$rabbit_bin/$tool" ]; then
            echo rabbitmq-server
            break
        fi
    done
}

need() {
    local missing
    missing="$(missing_packages | paste -sd ' ')"
    [ -z "$missing" ] ||
        die "missing $missing: install it (as root on Debian: apt-get install -y $missing), or set SAS_SERVERS_PG_BIN / RABBITMQ_BIN"
}

listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Polls `$2...` (a command) twice a second until it succeeds, or fails with
# `$1` once the time is up.
wait_for() {
    local what="$1" deadline=$((SECONDS + timeout_s))
    shift
    until "$@"; do
        [ "$SECONDS" -lt "$deadline" ] || die "$what not within ${timeout_s}s (logs in $dir)"
        sleep 0.5
    done
}

# ---- Postgres

# Runs a Postgres tool as the postgres OS user when we are root (initdb and
# pg_ctl refuse root), from a directory that user can read.
as_pg() {
    if is_root; then
        (cd / && runuser -u postgres -- "$@")
    else
        "$@"
    fi
}

pg_running() { [ -f "$data/PG_VERSION" ] && as_pg "$pg_bin/pg_ctl" status -D "$data" >/dev/null 2>&1; }
pg_ready() { "$pg_bin/pg_isready" -q -h 127.0.0.1 -p "$pg_port" -U postgres -d postgres; }

pg_init() {
    [ -f "$data/PG_VERSION" ] && return 0
    mkdir -p "$pgdir"
    ! is_root || chown postgres: "$pgdir"
    chmod 700 "$pgdir"
    as_pg "$pg_bin/initdb" -D "$data" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 --no-sync \
        >"$pgdir/initdb.log" 2>&1 || die "initdb of $data failed; see $pgdir/initdb.log"
    # A socket path longer than the kernel's limit (107 bytes) fails the
    # start: then TCP only, which is all the tests and pg_ctl -w use.
    local sockets="$pgdir"
    [ "${#sockets}" -le 90 ] || sockets=""
    cat >>"$data/postgresql.conf" <<EOF

# scripts/servers.sh: this checkout's private Postgres.
listen_addresses = '127.0.0.1'
port = $pg_port
unix_socket_directories = '$sockets'
max_connections = 200
fsync = off
cluster_name = 'sas-servers'
log_line_prefix = '%m [%p] %q%u@%d '
EOF
}

pg_start() {
    if ! pg_running; then
        ! listening "$pg_port" ||
            die "something else listens on 127.0.0.1:$pg_port (SAS_SERVERS_PG_PORT picks another port, after scripts/servers.sh down)"
        as_pg "$pg_bin/pg_ctl" start -D "$data" -l "$pglog" -w -t "$timeout_s" -s </dev/null >/dev/null 2>&1 ||
            die "Postgres did not come up on 127.0.0.1:$pg_port within ${timeout_s}s; see $pglog: $(tail -n 3 "$pglog" 2>/dev/null | tr '\n' ' ')"
    fi
    wait_for "Postgres accepting connections on 127.0.0.1:$pg_port" pg_ready
}

# pg_stop MODE: fast (clean) or immediate (the data is thrown away).
pg_stop() {
    pg_running || return 0
    as_pg "$pg_bin/pg_ctl" stop -D "$data" -m "$1" -w -t "$timeout_s" -s >/dev/null 2>&1 ||
        die "Postgres did not stop within ${timeout_s}s; see $pglog"
}

# ---- RabbitMQ

# The environment RabbitMQ's scripts read, the server's and the CLI's alike:
# our own env file, configuration and plugin list, so that nothing of the
# machine node's (/etc/rabbitmq: its name, its 5672 listener) applies.
rabbit_env() {
    export HOME="$rdir"
    export RABBITMQ_CONF_ENV_FILE="$rdir/rabbitmq-env.conf"
    export RABBITMQ_ENABLED_PLUGINS_FILE="$rdir/enabled_plugins"
    export RABBITMQ_NODENAME="$node"
    export RABBITMQ_CONFIG_FILE="$rdir/rabbitmq.conf"
    export RABBITMQ_ADVANCED_CONFIG_FILE="$rdir/advanced.config"
    export RABBITMQ_MNESIA_BASE="$rdir/mnesia"
    export RABBITMQ_LOG_BASE="$rdir/log"
    export RABBITMQ_PID_FILE="$rdir/pid"
    export RABBITMQ_DIST_PORT="$dist_port"
    # Distribution and epmd on loopback only, as the machine's node has them.
    export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
    export ERL_EPMD_ADDRESS=127.0.0.1
}

# A RabbitMQ CLI tool ($1) against the node.
ctl() {
    local tool="$1"
    shift
    (
        rabbit_env
        "$rabbit_bin/$tool" -q -n "$node" "$@"
    )
}

# The node's files: the cookie is kept if present, the rest rewritten.
rabbit_init() {
    mkdir -p "$rdir/mnesia" "$rdir/log"
    chmod 700 "$rdir"
    if [ ! -s "$rdir/.erlang.cookie" ]; then
        (umask 077 && head -c 30 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$rdir/.erlang.cookie")
    fi
    chmod 400 "$rdir/.erlang.cookie"
    : >"$rdir/rabbitmq-env.conf"
    echo '[].' >"$rdir/enabled_plugins"
    cat >"$rdir/rabbitmq.conf" <<EOF
# scripts/servers.sh: this checkout's private node; RabbitMQ's defaults otherwise.
listeners.tcp.local = 127.0.0.1:$amqp_port
# guest logs in from loopback only, which is where every client is.
loopback_users.guest = true
EOF
}

rabbit_pid() { [ -s "$rdir/pid" ] && cat "$rdir/pid"; }

# Whether the node's VM is alive (by its pid file).
rabbit_alive() {
    local pid
    pid="$(rabbit_pid)" || return 1
    kill -0 "$pid" 2>/dev/null
}

# Whether the RabbitMQ application runs on the node and takes connections.
rabbit_running() {
    rabbit_alive && ctl rabbitmq-diagnostics check_running >/dev/null 2>&1 && listening "$amqp_port"
}

gone() { ! kill -0 "$1" 2>/dev/null; }

rabbit_start_node() {
    rm -f "$rdir/pid"
    local port
    for port in "$amqp_port" "$dist_port"; do
        ! listening "$port" ||
            die "something else listens on 127.0.0.1:$port (SAS_SERVERS_AMQP_PORT / SAS_SERVERS_DIST_PORT pick others, after scripts/servers.sh down)"
    done
    (
        rabbit_env
        cd "$rdir"
        exec setsid "$rabbit_bin/rabbitmq-server" </dev/null >>"$rdir/log/console.log" 2>&1
    ) &
    local job=$!
    # A VM that exits early (a port or the node name in use, a bad
    # configuration) ends the wait at once.
    local deadline=$((SECONDS + timeout_s))
    until rabbit_running; do
        if ! kill -0 "$job" 2>/dev/null; then
            die "$node exited while starting; see $rdir/log/console.log: $(tail -n 3 "$rdir/log/console.log" | tr '\n' ' ')"
        fi
        [ "$SECONDS" -lt "$deadline" ] || die "$node not running within ${timeout_s}s; see $rdir/log"
        sleep 0.5
    done
}

# Starts whatever is down: the node, or the application on a running node.
rabbit_start() {
    if rabbit_alive; then
        rabbit_running || ctl rabbitmqctl start_app >/dev/null ||
            die "rabbitmqctl start_app on $node failed; see $rdir/log"
        wait_for "$node running, AMQP on 127.0.0.1:$amqp_port" rabbit_running
    else
        rabbit_start_node
    fi
}

# Stops the node's VM: cleanly, or (`kill`) at once, its data being thrown away.
rabbit_stop() {
    rabbit_alive || return 0
    local pid
    pid="$(rabbit_pid)"
    if [ "${1:-}" = kill ]; then
        kill -KILL "$pid" 2>/dev/null || true
    else
        ctl rabbitmqctl stop >/dev/null || die "rabbitmqctl stop on $node failed; see $rdir/log"
    fi
    wait_for "$node stopped" gone "$pid"
}

# ---- commands

# Keeps the servers' ports out of the kernel's ephemeral range, where it
# can be taken: a test's outgoing connection that happens to get one as its
# local port (and lingers in TIME_WAIT) keeps the server from listening on
# it ("Address already in use"). Root only; best effort.
reserve_ports() {
    local file=/proc/sys/net/ipv4/ip_local_reserved_ports current port
    [ -w "$file" ] || return 0
    current=$(cat "$file")
    for port in "$pg_port" "$amqp_port" "$dist_port"; do
        case ",$current," in
        *",$port,"*) ;;
        *) current="${current:+$current,}$port" ;;
        esac
    done
    echo "$current" >"$file" 2>/dev/null || true
}

cmd_up() {
    need
    if [ -e "$dir" ] && [ ! -f "$marker" ]; then
        die "$dir exists but was not made by scripts/servers.sh (no $marker); remove it or set SAS_SERVERS_DIR"
    fi
    if [ ! -e "$dir" ]; then
        mkdir -p "$dir"
        : >"$marker"
        echo "$pg_port $amqp_port $dist_port $node" >"$settings"
    fi
    # The postgres OS user passes through to its own directory.
    chmod 755 "$dir"
    reserve_ports
    local t0=$SECONDS
    pg_init
    pg_start
    rabbit_init
    if ! rabbit_running; then
        rabbit_start
    fi
    say "up ($((SECONDS - t0))s): Postgres 127.0.0.1:$pg_port, RabbitMQ $node on 127.0.0.1:$amqp_port; in $dir"
}

cmd_env() {
    [ -f "$marker" ] || die "no servers in $dir: scripts/servers.sh up first"
    printf 'export %s=%q\n' \
        SAS_SERVERS_DIR "$dir" \
        SAS_TEST_DATABASE_URL "$db_url" \
        SAS_TEST_BROKER_URL "$amqp_url" \
        SAS_TEST_PG_BIN "$pg_bin" \
        SAS_TEST_RABBITMQ_BIN "$rabbit_bin" \
        SAS_TEST_RABBITMQ_NODE "$node" \
        SAS_TEST_RABBITMQ_HOME "$rdir"
}

cmd_status() {
    local ok=0
    if [ ! -f "$marker" ]; then
        echo "no servers in $dir"
        return 4
    fi
    if pg_running && pg_ready; then
        echo "postgres 127.0.0.1:$pg_port: running ($data)"
    else
        echo "postgres 127.0.0.1:$pg_port: stopped"
        ok=3
    fi
    if rabbit_running; then
        echo "rabbitmq $node 127.0.0.1:$amqp_port: running"
    elif rabbit_alive; then
        echo "rabbitmq $node 127.0.0.1:$amqp_port: VM up, RabbitMQ not running"
        ok=3
    else
        echo "rabbitmq $node 127.0.0.1:$amqp_port: stopped"
        ok=3
    fi
    return "$ok"
}

cmd_stop() {
    [ -f "$marker" ] || return 0
    pg_stop fast
    rabbit_stop
    say "stopped; the data stays in $dir"
}

cmd_down() {
    [ -e "$dir" ] || return 0
    [ -f "$marker" ] || die "$dir was not made by scripts/servers.sh (no $marker); not removing it"
    if [ -x "$pg_bin/pg_ctl" ]; then
        pg_stop immediate
    fi
    rabbit_stop kill
    rm -rf -- "$dir"
    say "stopped and removed $dir"
}

# For the restart tests: one server at a time, of servers that are up.
one() {
    [ -f "$marker" ] || die "no servers in $dir: scripts/servers.sh up first"
    need
    case "$1" in
    pg-stop) pg_stop fast ;;
    pg-start) pg_start ;;
    rabbit-stop-app) ctl rabbitmqctl stop_app >/dev/null || die "rabbitmqctl stop_app on $node failed" ;;
    rabbit-start-app)
        ctl rabbitmqctl start_app >/dev/null || die "rabbitmqctl start_app on $node failed"
        wait_for "$node running" rabbit_running
        ;;
    rabbit-stop) rabbit_stop ;;
    rabbit-start) rabbit_start ;;
    esac
}

case "${1:-}" in
up) cmd_up ;;
env) cmd_env ;;
status) cmd_status ;;
stop) cmd_stop ;;
down) cmd_down ;;
missing) missing_packages ;;
ctl)
    [ $# -ge 2 ] || usage 2
    need
    shift
    ctl "$@"
    ;;
pg-stop | pg-start | rabbit-stop-app | rabbit-start-app | rabbit-stop | rabbit-start) one "$1" ;;
-h | --help | help) usage 0 ;;
*) usage 2 ;;
esac
