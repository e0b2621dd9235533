#!/usr/bin/env bash
# Runs every test against the real Postgres (127.0.0.1:5432) and RabbitMQ
# (127.0.0.1:5672). Builds the binaries first: the end-to-end tests start them.
# Tests that restart a server or start servers of their own (modules
# `restarts`, `cluster`, `failover` and `partition` of the one end-to-end
# binary, tests/tests/suite) run alone, after the rest.
# Extra arguments go to nextest, e.g. `scripts/test.sh -E 'test(hanging)'`.
#
# Sets itself up first: what the tests need and the machine lacks (Debian's
# chromium and chromium-driver for the dashboard's browser tests, stunnel4 and
# openssl for the TLS tests, faketime for the clock tests, cargo-nextest) is installed when it can be (root
# with apt-get, as on the Debian 12 machines the README names). When it
# cannot, one line says what to install and the script exits 1 before
# building.
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

# The services the tests run against: started by the caller (.ci/run does).
for service in "Postgres 5432" "RabbitMQ 5672"; do
    name=${service% *}
    port=${service#* }
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        say "$name is not listening on 127.0.0.1:$port: start it (see the README's Quick start), then run again"
        exit 1
    fi
done

profile=default
[ "${CI:-}" = "true" ] && profile=ci

cargo build --workspace --all-targets
restarts='binary_id(sas-tests::suite) & test(/^(restarts|cluster|failover|partition)::/)'
if [ -f tests/tests/suite/restarts.rs ]; then
    cargo nextest run --workspace --profile "$profile" -E "not ($restarts)" "$@"
    cargo nextest run --workspace --profile "$profile" --test-threads 1 -E "$restarts" "$@"
else
    cargo nextest run --workspace --profile "$profile" "$@"
fi
