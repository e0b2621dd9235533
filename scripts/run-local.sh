#!/usr/bin/env bash
# Runs the whole sas suite on this machine, without Docker, against a
# Postgres and a RabbitMQ of its own:
#
#   1. builds the release binaries (cargo build --release --workspace),
#   2. starts private servers with scripts/servers.sh (unless told to use
#      others, below): Postgres on 127.0.0.1:55433 and RabbitMQ node
#      sas-local@localhost on 127.0.0.1:55673, in target/sas-servers-local/
#      (other ports and a directory of their own than scripts/test.sh's, so
#      that both can run at once),
#   3. starts remote-sim, submission, scheduler, agent, supervisor and the
#      dashboard in the background with SAS_CONFIG=config/local.toml (logs in .run/<name>.log,
#      process ids in .run/<name>.pid),
#   4. waits until each answers /healthz (remote-sim) or /readyz (services),
#   5. runs the demo application (scripts/demo-app.sh) with target/release/sasctl,
#      printing one line per order as it ends (`order <id>: received →
#      processing → reserve → charge → ship → processed in 412 ms`), and a
#      count at the end; `--json` prints the raw status events instead
#      (JSON lines, as `sasctl watch` does),
#   6. on exit, Ctrl-C or SIGTERM, sends SIGTERM to everything it started and
#      waits for it to stop, then stops the private servers if it started
#      them. Their data stays for the next run; remove it with
#      `SAS_SERVERS_DIR=target/sas-servers-local scripts/servers.sh down`.
#
#   scripts/run-local.sh [--json]
#
# Ports: remote-sim 8081 (the agents' URLs in config/local.toml), submission
# 9101, scheduler 9102, agent 9103, supervisor 9104, dashboard 9105
# (http://127.0.0.1:9105/); they must be free.
#
# Environment:
#   SAS__BROKER__PREFIX   queue-name prefix (default sas); use a throwaway one
#                         to keep a run apart from other deployments
#   SAS__DATABASE__URL    Postgres URL (default: the private server's, database
#                         sas); the database is created when missing
#   SAS__BROKER__URL      AMQP URL (default: the private node's). With both
#                         given no server is started
#   SAS_LOCAL_SERVERS=0   start no server: the URLs of the two variables above
#                         (the machine's own servers on 127.0.0.1:5432 and :5672,
#                         say), or those of the configuration file
#                         (config/local.toml names the private servers' defaults)
#   SAS_LOCAL_SERVERS_DIR the private servers' directory (default
#                         target/sas-servers-local)
#   SAS_LOCAL_PG_PORT, SAS_LOCAL_AMQP_PORT, SAS_LOCAL_DIST_PORT
#                         their ports (default 55433, 55673 and 25681, the
#                         RabbitMQ node's Erlang distribution), read when they
#                         are made (see scripts/servers.sh)
#   SAS_CONFIG            configuration file (default config/local.toml)
#   DEMO_ORDERS           orders the demo submits (default 20)
#   DEMO_QUEUE            the demo's status queue (default <prefix>-demo.status)
#   DEMO_WATCH_TIMEOUT    how long the demo watches for events (default 30s)
#   SAS_SKIP_BUILD=1      use the binaries already built (in SAS_BIN_DIR)
#   SAS_BIN_DIR           where the binaries are (default target/release; CI
#                         gives target/debug, which the tests built)
#   SAS_KEEP_RUNNING=1    keep the suite running after the demo until Ctrl-C
#   READY_TIMEOUT         seconds to wait for each process to be ready (default 90)
#   STOP_TIMEOUT          seconds each process gets to stop after SIGTERM (default 20)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

json=0
for arg in "$@"; do
    case "$arg" in
    --json) json=1 ;;
    -h | --help)
        sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "run-local: unknown argument '$arg' (scripts/run-local.sh [--json])" >&2
        exit 2
        ;;
    esac
done

run_dir="$root/.run"
bin_dir="${SAS_BIN_DIR:-${CARGO_TARGET_DIR:-$root/target}/release}"
ready_timeout=${READY_TIMEOUT:-90}
stop_timeout=${STOP_TIMEOUT:-20}
remote_sim_port=8081

export SAS_CONFIG="${SAS_CONFIG:-$root/config/local.toml}"
export DEMO_ORDERS="${DEMO_ORDERS:-20}"
export DEMO_QUEUE="${DEMO_QUEUE:-${SAS__BROKER__PREFIX:-sas}-demo.status}"
export DEMO_WATCH_TIMEOUT="${DEMO_WATCH_TIMEOUT:-30s}"
# Each service gets its own port below; a global one would make them collide.
unset SAS__HTTP__PORT

# Names and process ids of what this script started, in start order.
names=()
pids=()
demo_pid=""
summary_pid=""
dashboard_url="http://127.0.0.1:9105/"
# What the private servers were before this script: running (left so), or
# stopped or absent (stopped at the end); empty when none are used.
servers_before=""
reach=()

log() {
    printf 'run-local: %s\n' "$*" >&2
}

die() {
    log "error: $*"
    exit 1
}

# Stops every process this script started: SIGTERM to the sas services first,
# then to remote-sim (agents may still be finishing calls to it), each given
# STOP_TIMEOUT seconds before SIGKILL.
# shellcheck disable=SC2317  # reached through the EXIT trap
stop_all() {
    local i
    local -a sas=() sim=()
    for i in "${!names[@]}"; do
        if [[ ${names[$i]} == remote-sim ]]; then
            sim+=("$i")
        else
            sas+=("$i")
        fi
    done
    stop_group "${sas[@]}"
    stop_group "${sim[@]}"
}

# shellcheck disable=SC2317  # reached through the EXIT trap
stop_group() {
    local i pid deadline
    for i in "$@"; do
        pid=${pids[$i]}
        if kill -0 "$pid" 2>/dev/null; then
            log "stopping ${names[$i]} (pid $pid)"
            kill -TERM "$pid" 2>/dev/null || true
        fi
    done
    deadline=$((SECONDS + stop_timeout))
    for i in "$@"; do
        pid=${pids[$i]}
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do
            sleep 0.2
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "${names[$i]} (pid $pid) did not stop within ${stop_timeout}s; killing it"
            kill -KILL "$pid" 2>/dev/null || true
        fi
        wait "$pid" 2>/dev/null || true
        rm -f "$run_dir/${names[$i]}.pid"
    done
}

# shellcheck disable=SC2317  # reached through the EXIT trap
cleanup() {
    local status=$?
    trap - EXIT INT TERM
    if [[ -n $demo_pid ]] && kill -0 "$demo_pid" 2>/dev/null; then
        log "stopping the demo application (pid $demo_pid)"
        # Its sasctl first (a child of the script, unless exec'd), then the script.
        pkill -TERM -P "$demo_pid" 2>/dev/null || true
        kill -TERM "$demo_pid" 2>/dev/null || true
        wait "$demo_pid" 2>/dev/null || true
    fi
    if [[ -n $summary_pid ]] && kill -0 "$summary_pid" 2>/dev/null; then
        kill -TERM "$summary_pid" 2>/dev/null || true
        wait "$summary_pid" 2>/dev/null || true
    fi
    if ((${#pids[@]} > 0)); then
        stop_all
        log "stopped; logs are in ${run_dir#"$root"/}/"
    fi
    if [[ -n $servers_before && $servers_before != 0 ]]; then
        servers stop || log "could not stop the private servers; see scripts/servers.sh status"
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# scripts/servers.sh for this script's private servers.
servers() {
    SAS_SERVERS_DIR="${SAS_LOCAL_SERVERS_DIR:-$root/target/sas-servers-local}" \
        SAS_SERVERS_PG_PORT="${SAS_LOCAL_PG_PORT:-55433}" \
        SAS_SERVERS_AMQP_PORT="${SAS_LOCAL_AMQP_PORT:-55673}" \
        SAS_SERVERS_DIST_PORT="${SAS_LOCAL_DIST_PORT:-25681}" \
        SAS_SERVERS_NODE=sas-local@localhost \
        "$root/scripts/servers.sh" "$@"
}

# Reads sasctl watch's JSON lines and prints one line per order once it
# ends (its states in order, a step named for each that succeeded, and how
# long from the first event to the last), then those that did not end, the
# count by end state, the p50 and p99 of those times, and where the
# dashboard is. Lines that are no status event pass as they are.
summarize() {
    jq -nrR --unbuffered --arg dashboard "$dashboard_url" '
def seconds:
  capture("^(?<s>[^.Z]+)(?<f>[.][0-9]+)?Z$")
  | ((.s + "Z") | fromdateiso8601) + ((.f // ".0") | tonumber);
def word:
  if .state == "step_succeeded" then .step // "step"
  elif .state == "retry_scheduled" then "retry " + (.step // "step")
  elif .state == "rejected" and (.detail.error | type) == "string" then "rejected (\(.detail.error))"
  else .state end;
def took($events):
  ($events | unique_by(.seq)) as $e
  | ((($e[-1].at | seconds) - ($e[0].at | seconds)) * 1000) | floor;
def story($id; $events; $ended):
  ($events | unique_by(.seq)) as $e
  | "order \($id): " + ([$e[] | word] | join(" → "))
    + if $ended then " in \(took($e)) ms" else " (no end seen)" end;
def pct($sorted; $q):
  if ($sorted | length) == 0 then "-"
  else "\($sorted[((($sorted | length) * $q) | ceil) - 1]) ms" end;
foreach ((inputs | (fromjson? | objects) // {line: .}), {"sas-demo-end": true}) as $m (
  {orders: {}, ended: {}, took: [], out: []};
  if $m["sas-demo-end"] then
    (.took | sort) as $took
    | .out = [.orders | to_entries[] | story(.key; .value; false)]
      + [(.ended | to_entries | map("\(.value) \(.key)") | join(", ")) as $counts
         | "\(.ended | add // 0) orders ended\(if $counts == "" then "" else ": " + $counts end); \(.orders | length) did not",
         "first event to last: p50 \(pct($took; 0.5)), p99 \(pct($took; 0.99)); the dashboard: \($dashboard)"]
  elif ($m.state | type) == "string" then
    ($m.order_id | if type == "string" then . else tojson end) as $id
    | .orders[$id] += [$m]
    | if ["processed", "compensated", "failed", "rejected"] | index([$m.state]) then
        .out = [story($id; .orders[$id]; true)]
        | .took += [took(.orders[$id])]
        | del(.orders[$id])
        | .ended[$m.state] += 1
      else .out = [] end
  else .out = [$m.line // ($m | tojson)]
  end;
  .out[]
)'
}

# True when something accepts connections on 127.0.0.1:$1.
port_in_use() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# start NAME PORT COMMAND...: runs COMMAND in the background, logging to .run/NAME.log.
start() {
    local name=$1 port=$2
    shift 2
    "$@" >"$run_dir/$name.log" 2>&1 &
    local pid=$!
    names+=("$name")
    pids+=("$pid")
    echo "$pid" >"$run_dir/$name.pid"
    log "started $name (pid $pid, port $port, log ${run_dir#"$root"/}/$name.log)"
}

# wait_ready NAME URL: waits until URL answers 2xx, or fails when NAME exits.
wait_ready() {
    local name=$1 url=$2 i pid=""
    for i in "${!names[@]}"; do
        if [[ ${names[$i]} == "$name" ]]; then
            pid=${pids[$i]}
        fi
    done
    local deadline=$((SECONDS + ready_timeout))
    until curl -fsS -o /dev/null --max-time 2 "$url" 2>/dev/null; do
        if ! kill -0 "$pid" 2>/dev/null; then
            log "$name exited before it was ready; the end of its log:"
            tail -n 20 "$run_dir/$name.log" >&2 || true
            die "$name did not start"
        fi
        if ((SECONDS >= deadline)); then
            log "the end of $name's log:"
            tail -n 20 "$run_dir/$name.log" >&2 || true
            die "$name was not ready at $url within ${ready_timeout}s"
        fi
        sleep 0.5
    done
    log "$name is ready"
}

command -v curl >/dev/null || die "curl is needed to wait for the services"
[[ -f $SAS_CONFIG ]] || die "configuration file $SAS_CONFIG does not exist"

if [[ ${SAS_SKIP_BUILD:-0} != 1 ]]; then
    log "building (cargo build --release --workspace)"
    cargo build --release --workspace
fi
for bin in remote-sim submission scheduler agent supervisor dashboard sasctl; do
    [[ -x $bin_dir/$bin ]] || die "$bin_dir/$bin is missing; build first (or unset SAS_SKIP_BUILD)"
done

for port in "$remote_sim_port" 9101 9102 9103 9104 9105; do
    if port_in_use "$port"; then
        die "port $port is already in use (another run of the suite?); stop whatever listens there first"
    fi
done

mkdir -p "$run_dir"

# The servers: the private ones unless both URLs are given or none is wanted.
if [[ ${SAS_LOCAL_SERVERS:-1} != 0 && (-z ${SAS__DATABASE__URL:-} || -z ${SAS__BROKER__URL:-}) ]]; then
    servers_before=0
    servers status >/dev/null 2>&1 || servers_before=$?
    servers up || die "the private servers did not start (scripts/servers.sh says why above)"
    # Their URLs, from the export lines the tests use.
    read -r db_admin broker < <(
        eval "$(servers env)"
        echo "$SAS_TEST_DATABASE_URL $SAS_TEST_BROKER_URL"
    )
    [[ -n ${broker:-} ]] || die "scripts/servers.sh env gave no URLs"
    # What sasctl needs to reach them, said when the suite keeps running.
    # config/local.toml names the default ports; other ports need these.
    reach=()
    if [[ -z ${SAS__DATABASE__URL:-} ]]; then
        export SAS__DATABASE__URL="${db_admin%/postgres}/sas"
        [[ $SAS__DATABASE__URL == postgres://postgres@127.0.0.1:55433/sas ]] ||
            reach+=("SAS__DATABASE__URL='$SAS__DATABASE__URL'")
    fi
    if [[ -z ${SAS__BROKER__URL:-} ]]; then
        export SAS__BROKER__URL="$broker"
        [[ $SAS__BROKER__URL == "amqp://guest:guest@127.0.0.1:55673/%2f" ]] ||
            reach+=("SAS__BROKER__URL='$SAS__BROKER__URL'")
    fi
fi
log "configuration ${SAS_CONFIG}, prefix ${SAS__BROKER__PREFIX:-sas}"

start remote-sim "$remote_sim_port" \
    "$bin_dir/remote-sim" --host 127.0.0.1 --port "$remote_sim_port" \
    --knobs "$root/config/remote-sim-knobs.json"
start submission 9101 env SAS__HTTP__PORT=9101 "$bin_dir/submission"
start scheduler 9102 env SAS__HTTP__PORT=9102 "$bin_dir/scheduler"
start agent 9103 env SAS__HTTP__PORT=9103 "$bin_dir/agent"
start supervisor 9104 env SAS__HTTP__PORT=9104 "$bin_dir/supervisor"
start dashboard 9105 env SAS__HTTP__PORT=9105 "$bin_dir/dashboard"

wait_ready remote-sim "http://127.0.0.1:$remote_sim_port/healthz"
wait_ready submission http://127.0.0.1:9101/readyz
wait_ready scheduler http://127.0.0.1:9102/readyz
wait_ready agent http://127.0.0.1:9103/readyz
wait_ready supervisor http://127.0.0.1:9104/readyz
wait_ready dashboard http://127.0.0.1:9105/readyz
log "the dashboard is on $dashboard_url"

log "running the demo application (${DEMO_ORDERS} orders, status queue ${DEMO_QUEUE})"
if ((json == 0)) && ! command -v jq >/dev/null 2>&1; then
    log "jq is missing (apt-get install -y jq): the demo prints the raw status events"
    json=1
fi
# In the background, so that a SIGTERM to this script is handled at once (bash
# runs traps only between foreground commands, but interrupts `wait`). The
# summary reads the demo's output through a FIFO, so that both have a pid to
# wait for and to stop.
if ((json)); then
    SASCTL="$bin_dir/sasctl" "$root/scripts/demo-app.sh" &
    demo_pid=$!
else
    fifo="$run_dir/demo.fifo"
    rm -f "$fifo"
    mkfifo "$fifo"
    summarize <"$fifo" &
    summary_pid=$!
    SASCTL="$bin_dir/sasctl" "$root/scripts/demo-app.sh" >"$fifo" &
    demo_pid=$!
fi
demo_status=0
wait "$demo_pid" || demo_status=$?
demo_pid=""
if [[ -n $summary_pid ]]; then
    wait "$summary_pid" || true
    summary_pid=""
    rm -f "$fifo"
fi
if ((demo_status != 0)); then
    log "the demo application exited with status $demo_status"
fi

if [[ ${SAS_KEEP_RUNNING:-0} == 1 ]]; then
    log "the suite keeps running (dashboard on http://127.0.0.1:9105/, metrics on http://127.0.0.1:910{1..5}/metrics); Ctrl-C stops it"
    # sasctl and the clients: config/local.toml names the default ports.
    log "sasctl reaches the suite with: export SAS_CONFIG=config/local.toml${reach[*]:+ ${reach[*]}}"
    wait
fi
exit "$demo_status"
