#!/usr/bin/env bash
# Runs every test against a Postgres and a RabbitMQ of its own: by default it
# starts the private servers of scripts/servers.sh (Postgres on
# 127.0.0.1:55432, RabbitMQ node sas-test@localhost on 127.0.0.1:55672, both in
# target/sas-servers/), points the tests at them (SAS_TEST_DATABASE_URL,
# SAS_TEST_BROKER_URL and the rest of `scripts/servers.sh env`), and takes
# them down at the end, whatever happened (servers that were running before
# it stay up; stopped ones are stopped again, their data kept). The machine's
# own servers on 5432/5672 need not run, and are left alone. To use other
# servers instead, e.g. the machine's own, set both
#   SAS_TEST_DATABASE_URL  an admin URL to Postgres's `postgres` database
#                          (postgres://postgres@127.0.0.1:5432/postgres)
#   SAS_TEST_BROKER_URL    amqp://guest:guest@127.0.0.1:5672/%2f
# and nothing is started; the restart tests then restart the machine's own
# servers (they refuse other addresses, unless SAS_SERVERS_DIR names
# scripts/servers.sh's). SAS_SERVERS_DIR and the ports of scripts/servers.sh
# (its header) apply to the servers this script starts.
#
# Builds the binaries first: the end-to-end tests start them.
# Tests that restart a server or start servers of their own (modules
# `restarts`, `cluster`, `failover` and `partition` of the one end-to-end
# binary, tests/tests/suite) run alone, after the rest.
# Extra arguments go to nextest, e.g. `scripts/test.sh -E 'test(hanging)'`.
#
# Sets itself up first: what the tests need and the machine lacks (Debian's
# postgresql and rabbitmq-server for the private servers, chromium and
# chromium-driver for the dashboard's browser tests, stunnel4 and openssl for
# the TLS tests, faketime for the clock tests, cargo-nextest) is installed
# when it can be (root with apt-get, as on the Debian 12 machines the README
# names). When it cannot, one line says what to install and the script exits
# 1 before building.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "scripts/test.sh: $*" >&2; }

if ! command -v cargo >/dev/null 2>&1; then
    say "cargo not found: install Rust $(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml) or later (rustup.rs), then run again"
    exit 1
fi

# Debian packages for the commands the tests run. CHROMIUM and CHROMEDRIVER
# name other binaries; those are the caller's to provide.
missing=()
if [ -n "${CHROMIUM:-}" ]; then
    [ -x "$CHROMIUM" ] || { say "CHROMIUM=$CHROMIUM is not an executable: fix it or unset it to use Debian's chromium"; exit 1; }
else
    [ -x /usr/bin/chromium ] || missing+=(chromium)
fi
if [ -n "${CHROMEDRIVER:-}" ]; then
    [ -x "$CHROMEDRIVER" ] || { say "CHROMEDRIVER=$CHROMEDRIVER is not an executable: fix it or unset it to use Debian's chromium-driver"; exit 1; }
else
    [ -x /usr/bin/chromedriver ] || missing+=(chromium-driver)
fi
command -v stunnel >/dev/null 2>&1 || missing+=(stunnel4)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
command -v faketime >/dev/null 2>&1 || missing+=(faketime)

# Debian's postgresql and rabbitmq-server: the private servers, and whatever
# servers are used, the TLS tests' own Postgres (initdb) and the RabbitMQ
# users some tests make (rabbitmqctl). Installing them may also start the
# machine's own servers, which the tests leave alone.
while read -r package; do
    missing+=("$package")
done < <(scripts/servers.sh missing)

# The servers: the caller's (both URLs set), or the private ones.
if [ -n "${SAS_TEST_DATABASE_URL:-}" ] && [ -n "${SAS_TEST_BROKER_URL:-}" ]; then
    private=0
elif [ -n "${SAS_TEST_DATABASE_URL:-}${SAS_TEST_BROKER_URL:-}" ]; then
    say "set both SAS_TEST_DATABASE_URL and SAS_TEST_BROKER_URL (the caller's servers), or neither (private servers)"
    exit 1
else
    private=1
fi

if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "installing ${missing[*]} (apt-get)"
        export DEBIAN_FRONTEND=noninteractive
        if ! { apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null; }; then
            say "apt-get could not install ${missing[*]}: install them by hand, then run again"
            exit 1
        fi
    else
        say "missing ${missing[*]}: install them (as root on Debian: apt-get install -y ${missing[*]}), then run again"
        exit 1
    fi
fi

if ! cargo nextest --version >/dev/null 2>&1; then
    say "installing cargo-nextest (cargo install cargo-nextest --locked)"
    if ! cargo install cargo-nextest --locked --quiet; then
        say "could not install cargo-nextest: run 'cargo install cargo-nextest --locked', then run again"
        exit 1
    fi
fi

# The Python client's tests (tests/tests/suite/python.rs) run in a virtual
# environment of their own, target/sas-python, holding the package
# (clients/python), pika and pytest: made once, and installed again only
# when the package changed since (target/sas-python/.installed). A caller's
# SAS_TEST_PYTHON (an interpreter with pika and pytest) is used instead.
if [ -z "${SAS_TEST_PYTHON:-}" ]; then
    if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            say "installing python3 python3-venv (apt-get)"
            export DEBIAN_FRONTEND=noninteractive
            if ! { apt-get update -qq && apt-get install -y -qq python3 python3-venv >/dev/null; }; then
                say "apt-get could not install python3 python3-venv: install them by hand, then run again"
                exit 1
            fi
        else
            say "missing python3-venv: install it (as root on Debian: apt-get install -y python3 python3-venv), then run again"
            exit 1
        fi
    fi
    python_env=target/sas-python
    stamp="$python_env/.installed"
    if [ ! -x "$python_env/bin/python" ]; then
        rm -rf "$python_env" "$stamp"
        python3 -m venv "$python_env"
    fi
    if [ ! -f "$stamp" ] || [ -n "$(find clients/python/pyproject.toml clients/python/src -newer "$stamp" -type f ! -path '*/__pycache__/*' ! -path '*.egg-info/*' -print -quit)" ]; then
        say "installing the Python client with pika and pytest in $python_env (pip)"
        if ! "$python_env/bin/pip" install -q ./clients/python pytest; then
            say "pip could not install ./clients/python and pytest in $python_env: fix that (PyPI reachable?), then run again"
            exit 1
        fi
        touch "$stamp"
    fi
    SAS_TEST_PYTHON="$PWD/$python_env/bin/python"
fi
export SAS_TEST_PYTHON

# host:port of a postgres:// or amqp:// URL (default port $2).
address_of() {
    local rest="${1#*://}"
    rest="${rest%%[/?]*}"
    rest="${rest##*@}"
    case "$rest" in
    *:*) echo "$rest" ;;
    *) echo "$rest:$2" ;;
    esac
}

if [ "$private" = 1 ]; then
    # As they were before: running (a developer's: they stay up), stopped
    # (stopped again at the end, their data kept) or absent (taken down).
    before=0
    scripts/servers.sh status >/dev/null 2>&1 || before=$?
    case "$before" in
    0) after="left up" ;;
    3) after="stopped at the end" ;;
    *) after="taken down at the end" ;;
    esac
    # shellcheck disable=SC2317  # reached through the EXIT trap
    servers_after() {
        case "$before" in
        0) ;;
        3) scripts/servers.sh stop || true ;;
        *) scripts/servers.sh down || true ;;
        esac
    }
    trap servers_after EXIT
    scripts/servers.sh up
    eval "$(scripts/servers.sh env)"
    say "private servers: Postgres on $(address_of "$SAS_TEST_DATABASE_URL" 5432), RabbitMQ $SAS_TEST_RABBITMQ_NODE on $(address_of "$SAS_TEST_BROKER_URL" 5672) ($after)"
fi

# The servers the tests run against must answer.
for service in "Postgres $(address_of "$SAS_TEST_DATABASE_URL" 5432) SAS_TEST_DATABASE_URL" \
    "RabbitMQ $(address_of "$SAS_TEST_BROKER_URL" 5672) SAS_TEST_BROKER_URL"; do
    read -r name address variable <<<"$service"
    if ! (exec 3<>"/dev/tcp/${address%:*}/${address##*:}") 2>/dev/null; then
        say "$name is not listening on $address ($variable): start it, or unset both SAS_TEST_* URLs to use private servers, then run again"
        exit 1
    fi
done
export SAS_TEST_DATABASE_URL SAS_TEST_BROKER_URL

profile=default
[ "${CI:-}" = "true" ] && profile=ci

cargo build --workspace --all-targets
# The caller's filters (-E EXPR, -EEXPR, --filterset EXPR) narrow each phase:
# nextest ORs several -E, so they are joined here and ANDed with the phase's.
wanted=()
rest=()
while [ $# -gt 0 ]; do
    case "$1" in
    -E | --filterset | --filter-expr)
        [ $# -ge 2 ] || { say "$1 needs an expression"; exit 2; }
        wanted+=("($2)")
        shift 2
        ;;
    -E?*) wanted+=("(${1#-E})"); shift ;;
    --filterset=* | --filter-expr=*) wanted+=("(${1#*=})"); shift ;;
    *) rest+=("$1"); shift ;;
    esac
done
within() {
    if [ ${#wanted[@]} -eq 0 ]; then
        echo "$1"
    else
        local joined
        joined=$(IFS='|'; echo "${wanted[*]}")
        echo "($joined) & ($1)"
    fi
}
restarts='binary_id(sas-tests::suite) & test(/^(restarts|cluster|failover|partition)::/)'
if [ -f tests/tests/suite/restarts.rs ]; then
    cargo nextest run --workspace --profile "$profile" --no-tests pass -E "$(within "not ($restarts)")" "${rest[@]}"
    cargo nextest run --workspace --profile "$profile" --no-tests pass --test-threads 1 -E "$(within "$restarts")" "${rest[@]}"
else
    cargo nextest run --workspace --profile "$profile" -E "$(within "all()")" "${rest[@]}"
fi
