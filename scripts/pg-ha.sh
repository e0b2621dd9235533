#!/usr/bin/env bash
# A local Postgres pair for the failover tests (#26): a primary and a
# synchronous streaming standby, made with this machine's Postgres binaries
# (/usr/lib/postgresql/<version>/bin) in a directory of their own, each
# listening on 127.0.0.1 only, on ports of their own.
#
#   scripts/pg-ha.sh up        # initdb the primary, pg_basebackup the standby,
#                              # wait until it streams as the sync standby;
#                              # the last line printed is the URL
#   scripts/pg-ha.sh failover  # stop the primary (immediate), promote the
#                              # standby, wait until it accepts writes alone
#   scripts/pg-ha.sh status    # which ports are up, their roles, replication
#   scripts/pg-ha.sh url       # postgres://postgres@127.0.0.1:5441,127.0.0.1:5442/postgres?target_session_attrs=read-write
#   scripts/pg-ha.sh down      # stop both (immediate), remove the directory
#
# Environment:
#   SAS_PG_HA_DIR      data dirs, logs and sockets (default /tmp/sas-pg-ha):
#                      <dir>/pg-<port> is a node's data, <dir>/pg-<port>.log
#                      its server log, <dir> holds the unix sockets
#   SAS_PG_HA_PORTS    "primary,standby" (default 5441,5442), or
#   SAS_PG_HA_PRIMARY_PORT / SAS_PG_HA_STANDBY_PORT
#   SAS_PG_HA_BIN      the Postgres bin dir (default: pg_config --bindir, else
#                      the newest /usr/lib/postgresql/*/bin)
#   SAS_PG_HA_TIMEOUT  seconds each step may take (default 30)
# The ports of the pair made by `up` are kept in <dir>, and the other
# commands use them whatever the environment says.
#
# Durability: while both run, the primary has synchronous_commit = on and
# synchronous_standby_names = 'FIRST 1 (standby)', so a commit returns only
# once the standby has flushed it: an acknowledged commit survives the loss
# of the primary. The standby's own config has synchronous_standby_names
# empty (it has no effect while in recovery), so once promoted it accepts
# writes alone at once (no window where commits hang waiting for a standby
# that no longer exists). After `failover` the survivor is unreplicated; the
# old primary stays down (`down`, then `up`, to get a pair again). Note that
# synchronous_commit = on means flushed on the standby, not yet applied: a
# read on the standby right after a commit may not see it yet. And a commit
# whose wait for the standby is cancelled (client gone, statement killed) is
# committed on the primary all the same, only not acknowledged. initdb and
# pg_basebackup run with --no-sync (a throwaway test pair); the servers
# themselves fsync as usual.
#
# Leaves alone: the machine's own Postgres (the cluster of /etc/postgresql,
# 127.0.0.1:5432, sockets in /var/run/postgresql) and everything outside
# SAS_PG_HA_DIR. `down` removes SAS_PG_HA_DIR only if `up` made it (it
# carries a marker file). Run as root, initdb and pg_ctl run as the
# `postgres` OS user (they refuse root), and SAS_PG_HA_DIR is owned by it.
set -euo pipefail

usage() {
    echo "usage: scripts/pg-ha.sh up|down|failover|status|url" >&2
    sed -n '7,14s/^#//p' "$0" >&2
    exit 2
}

die() {
    echo "pg-ha: $*" >&2
    exit 1
}

# The environment must not steer psql elsewhere: every call names its
# host, port, user and database.
unset PGHOST PGHOSTADDR PGPORT PGUSER PGDATABASE PGSERVICE PGSERVICEFILE \
    PGOPTIONS PGTARGETSESSIONATTRS PGSSLMODE PGPASSWORD PGPASSFILE \
    PGAPPNAME PGDATA || true
export PGCONNECT_TIMEOUT=3

dir="${SAS_PG_HA_DIR:-/tmp/sas-pg-ha}"
case "$dir" in
    /*) ;;
    *) dir="$PWD/$dir" ;;
esac
dir="${dir%/}"
[ -n "$dir" ] || die "SAS_PG_HA_DIR must not be /"
marker="$dir/.sas-pg-ha"
timeout_s="${SAS_PG_HA_TIMEOUT:-30}"
slot=standby
app=standby

bin="${SAS_PG_HA_BIN:-}"
if [ -z "$bin" ]; then
    if command -v pg_config >/dev/null 2>&1 && [ -x "$(pg_config --bindir)/initdb" ]; then
        bin="$(pg_config --bindir)"
    else
        bin="$(find /usr/lib/postgresql -mindepth 2 -maxdepth 2 -name bin 2>/dev/null | sort -V | tail -n 1)"
    fi
fi
for tool in initdb pg_ctl pg_basebackup pg_isready psql; do
    [ -x "$bin/$tool" ] || die "no $tool in '${bin:-?}' (set SAS_PG_HA_BIN to the Postgres bin dir)"
done

# The ports: those `up` recorded, else the environment's, else 5441/5442.
if [ -f "$dir/ports" ]; then
    read -r port1 port2 <"$dir/ports"
elif [ -n "${SAS_PG_HA_PORTS:-}" ]; then
    IFS=', ' read -r port1 port2 <<<"$SAS_PG_HA_PORTS"
else
    port1="${SAS_PG_HA_PRIMARY_PORT:-5441}"
    port2="${SAS_PG_HA_STANDBY_PORT:-5442}"
fi
for p in "${port1:-}" "${port2:-}"; do
    if ! [[ "$p" =~ ^[0-9]+$ ]] || [ "$p" -lt 1 ] || [ "$p" -gt 65535 ]; then
        die "bad port '$p' (SAS_PG_HA_PORTS=primary,standby)"
    fi
done
[ "$port1" != "$port2" ] || die "the two ports must differ (both $port1)"
if [ "$port1" = 5432 ] || [ "$port2" = 5432 ]; then
    die "5432 is the machine's Postgres; pick other ports"
fi

url="postgres://postgres@127.0.0.1:$port1,127.0.0.1:$port2/postgres?target_session_attrs=read-write"

data() { echo "$dir/pg-$1"; }
logf() { echo "$dir/pg-$1.log"; }

# Runs a Postgres tool as the postgres OS user when we are root (initdb and
# pg_ctl refuse root), from a directory that user can read.
as_pg() {
    if [ "$(id -u)" -eq 0 ]; then
        (cd / && runuser -u postgres -- "$@")
    else
        "$@"
    fi
}

# psql on 127.0.0.1:<port> as postgres: one unaligned, tuples-only result.
q() {
    local port="$1"
    shift
    "$bin/psql" -X -qAt -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$port" -U postgres -d postgres "$@"
}

answers() { "$bin/pg_isready" -q -h 127.0.0.1 -p "$1" -U postgres -d postgres; }

# The role of the server on <port>: primary, standby or down.
role() {
    local r
    r="$(q "$1" -c 'select pg_is_in_recovery()' 2>/dev/null)" || { echo down; return; }
    case "$r" in
        f) echo primary ;;
        t) echo standby ;;
        *) echo down ;;
    esac
}

# Polls <command...> once a second until it succeeds or the step's time is up.
wait_for() {
    local deadline=$((SECONDS + timeout_s))
    until "$@"; do
        [ "$SECONDS" -lt "$deadline" ] || return 1
        sleep 1
    done
}

start_node() {
    local port="$1" what="$2"
    as_pg "$bin/pg_ctl" start -D "$(data "$port")" -l "$(logf "$port")" -w -t "$timeout_s" -s >/dev/null 2>&1 ||
        die "the $what did not come up on 127.0.0.1:$port (waited up to ${timeout_s}s); see $(logf "$port")"
}

# Stops the server of a data dir (immediate) if it runs.
stop_dir() {
    local d="$1"
    [ -d "$d" ] || return 0
    as_pg "$bin/pg_ctl" status -D "$d" >/dev/null 2>&1 || return 0
    as_pg "$bin/pg_ctl" stop -D "$d" -m immediate -w -t "$timeout_s" -s >/dev/null 2>&1 ||
        die "the server of $d did not stop within ${timeout_s}s; see $d.log"
}

# The node's own settings, included by postgresql.conf (pg_basebackup copies
# the primary's file; the standby's is rewritten).
node_conf() {
    local port="$1" sync_names="$2"
    cat <<EOF
# Written by scripts/pg-ha.sh for the node on 127.0.0.1:$port.
port = $port
cluster_name = 'sas-pg-ha-$port'
synchronous_standby_names = '$sync_names'
EOF
}

sync_streaming() {
    [ "$(q "$port1" -c "select state || ' ' || sync_state from pg_stat_replication where application_name = '$app'" 2>/dev/null)" = "streaming sync" ]
}

cmd_up() {
    if [ -e "$dir" ]; then
        die "$dir already exists (a pair is up, or a failed run left it): scripts/pg-ha.sh down first"
    fi
    for p in "$port1" "$port2"; do
        if answers "$p" || (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
            die "something already listens on 127.0.0.1:$p (SAS_PG_HA_PORTS picks others)"
        fi
    done
    local t0=$SECONDS
    mkdir -p "$dir"
    : >"$marker"
    echo "$port1 $port2" >"$dir/ports"
    [ "$(id -u)" -ne 0 ] || chown -R postgres: "$dir"
    chmod 700 "$dir"

    local p1 p2
    p1="$(data "$port1")"
    p2="$(data "$port2")"
    as_pg "$bin/initdb" -D "$p1" -U postgres --auth=trust -E UTF8 --locale=C --no-sync >"$dir/initdb.log" 2>&1 ||
        die "initdb of $p1 failed; see $dir/initdb.log"

    cat >>"$p1/postgresql.conf" <<EOF

# scripts/pg-ha.sh: a primary with one synchronous streaming standby.
listen_addresses = '127.0.0.1'
unix_socket_directories = '$dir'
wal_level = replica
max_wal_senders = 5
max_replication_slots = 5
hot_standby = on
synchronous_commit = on
log_line_prefix = '%m [%p] %q%a '
include_if_exists = 'sas-node.conf'
EOF
    cat >"$p1/pg_hba.conf" <<EOF
# scripts/pg-ha.sh: trust, local and 127.0.0.1 only.
local   all          all                 trust
host    all          all   127.0.0.1/32  trust
local   replication  all                 trust
host    replication  all   127.0.0.1/32  trust
EOF
    node_conf "$port1" "FIRST 1 ($app)" >"$p1/sas-node.conf"
    [ "$(id -u)" -ne 0 ] || chown postgres: "$p1/pg_hba.conf" "$p1/sas-node.conf"
    start_node "$port1" primary

    # The standby: a base backup of the primary that creates and then uses
    # the slot, with -R writing primary_conninfo (naming the standby, as
    # synchronous_standby_names does) and standby.signal.
    as_pg "$bin/pg_basebackup" -D "$p2" -R -C -S "$slot" -X stream -c fast --no-sync \
        -d "host=127.0.0.1 port=$port1 user=postgres application_name=$app" \
        >"$dir/basebackup.log" 2>&1 ||
        die "pg_basebackup of the standby from 127.0.0.1:$port1 failed; see $dir/basebackup.log"
    grep -q "application_name=$app" "$p2/postgresql.auto.conf" ||
        die "pg_basebackup -R wrote no application_name=$app into $p2/postgresql.auto.conf"
    node_conf "$port2" "" >"$p2/sas-node.conf"
    [ "$(id -u)" -ne 0 ] || chown postgres: "$p2/sas-node.conf"
    start_node "$port2" standby

    wait_for sync_streaming ||
        die "the standby on 127.0.0.1:$port2 is not streaming as the sync standby of 127.0.0.1:$port1 after ${timeout_s}s; see $(logf "$port2") and $(logf "$port1")"
    echo "pg-ha: primary 127.0.0.1:$port1, sync standby 127.0.0.1:$port2 streaming ($((SECONDS - t0))s); data and logs in $dir" >&2
    echo "$url"
}

# A commit that writes WAL returns within 5 s on <port>: the server accepts
# writes (and waits for no missing sync standby).
accepts_writes() {
    [ "$(role "$1")" = primary ] &&
        timeout 5 "$bin/psql" -X -qAt -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$1" -U postgres -d postgres \
            -c 'select txid_current()' >/dev/null 2>&1
}

cmd_failover() {
    [ -f "$marker" ] || die "no pair in $dir (scripts/pg-ha.sh up first)"
    local primary="" standby="" p r
    for p in "$port1" "$port2"; do
        r="$(role "$p")"
        [ "$r" != primary ] || primary="$p"
        [ "$r" != standby ] || standby="$p"
    done
    [ -n "$standby" ] || die "no standby is running on 127.0.0.1:$port1 or :$port2 to promote (failed over already?); see scripts/pg-ha.sh status"
    local t0=$SECONDS
    if [ -n "$primary" ]; then
        stop_dir "$(data "$primary")"
        echo "pg-ha: stopped the primary on 127.0.0.1:$primary (immediate)" >&2
    fi

    # Its own config has synchronous_standby_names empty; make sure of it
    # before it takes writes (the setting applies from the promotion on).
    if [ -n "$(q "$standby" -c 'show synchronous_standby_names')" ]; then
        q "$standby" -c "alter system set synchronous_standby_names = ''" -c 'select pg_reload_conf()' >/dev/null
    fi
    as_pg "$bin/pg_ctl" promote -D "$(data "$standby")" -w -t "$timeout_s" -s >/dev/null 2>&1 ||
        die "the standby on 127.0.0.1:$standby was not promoted within ${timeout_s}s; see $(logf "$standby")"
    wait_for accepts_writes "$standby" ||
        die "the promoted server on 127.0.0.1:$standby does not accept writes after ${timeout_s}s; see $(logf "$standby")"
    echo "pg-ha: 127.0.0.1:$standby is the primary, alone ($((SECONDS - t0))s)" >&2
    echo "$url"
}

cmd_status() {
    local p r
    if [ ! -f "$marker" ]; then
        echo "no pair in $dir"
    fi
    for p in "$port1" "$port2"; do
        r="$(role "$p")"
        case "$r" in
            primary)
                local reps
                reps="$(q "$p" -F ' ' -c "select application_name, client_addr, state, sync_state, pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn) from pg_stat_replication" 2>/dev/null || true)"
                echo "127.0.0.1:$p up, primary (read-write), synchronous_standby_names = '$(q "$p" -c 'show synchronous_standby_names' 2>/dev/null)'"
                if [ -n "$reps" ]; then
                    while read -r name addr state sync lag; do
                        echo "  replica $name from $addr: $state, $sync, replay lag ${lag:-?} bytes"
                    done <<<"$reps"
                else
                    echo "  no replica connected"
                fi
                ;;
            standby)
                local wr
                wr="$(q "$p" -F ' ' -c "select status, sender_host || ':' || sender_port, slot_name from pg_stat_wal_receiver" 2>/dev/null || true)"
                echo "127.0.0.1:$p up, standby (in recovery, read-only), replay at $(q "$p" -c 'select pg_last_wal_replay_lsn()' 2>/dev/null)"
                if [ -n "$wr" ]; then
                    read -r st from sl <<<"$wr"
                    echo "  wal receiver: $st from $from, slot $sl"
                else
                    echo "  no wal receiver running"
                fi
                ;;
            *)
                echo "127.0.0.1:$p down"
                ;;
        esac
    done
    echo "url: $url"
}

cmd_down() {
    if [ ! -e "$dir" ]; then
        return 0
    fi
    [ -f "$marker" ] || die "$dir was not made by scripts/pg-ha.sh (no $marker); not removing it"
    local d
    for d in "$dir"/pg-*/; do
        [ -d "$d" ] || continue
        d="${d%/}"
        stop_dir "$d"
    done
    rm -rf -- "$dir"
    echo "pg-ha: stopped and removed $dir" >&2
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    failover) cmd_failover ;;
    status) cmd_status ;;
    url) echo "$url" ;;
    *) usage ;;
esac
