#!/usr/bin/env bash
# Checks the published documents and the README's first order, as CI does:
#
#   1. each published document by its own ecosystem's validator:
#      docs/asyncapi.json by the AsyncAPI Initiative's parser
#      (@asyncapi/parser, from npm), docs/openapi.json by
#      openapi-spec-validator, and each JSON Schema of docs/schemas/ (and
#      protocol's) as a schema of the draft it names (jsonschema's
#      check_schema);
#   2. starts the suite with scripts/run-local.sh (its private servers, its
#      ports) and runs, against it, every block of the README and
#      docs/getting-started.md marked `<!-- first-order: NAME -->`: sasctl and
#      HTTP in bash, Rust as client/examples/first_order.rs (which a test
#      keeps the same as the README's block), Python with the client package;
#      each must end with the order processed;
#   3. runs Schemathesis, from docs/openapi.json, against the live HTTP API
#      of that suite (no server error, responses as the document says),
#      then stops the suite.
#
#   scripts/check-docs.sh [static|live]     (default: both)
#
# The tools go into target/doc-tools (npm packages and a Python venv), made
# once. Environment:
#   SAS_BIN_DIR      where the binaries are (default target/release, built by
#                    run-local unless SAS_SKIP_BUILD=1; CI gives target/debug,
#                    which scripts/test.sh built)
#   SAS_SKIP_BUILD=1 use those binaries as they are
#   SAS_TEST_PYTHON  an interpreter with the Python client (default
#                    target/sas-python/bin/python, which scripts/test.sh makes)
#   SCHEMATHESIS_MAX_TIME  seconds Schemathesis may spend (default 60)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

what=${1:-all}
case "$what" in
all | static | live) ;;
*)
    echo "usage: scripts/check-docs.sh [static|live]" >&2
    exit 2
    ;;
esac

say() { echo "check-docs: $*" >&2; }
die() {
    say "FAILED: $*"
    exit 1
}

tools=target/doc-tools
asyncapi_parser=3.6.6

# The validators, installed once into target/doc-tools.
tools_up() {
    mkdir -p "$tools"
    if [ ! -f "$tools/node_modules/@asyncapi/parser/package.json" ]; then
        command -v npm >/dev/null || die "npm is needed for the AsyncAPI parser (apt-get install -y npm)"
        say "installing @asyncapi/parser@$asyncapi_parser into $tools (npm)"
        (cd "$tools" && npm install --no-audit --no-fund --silent --no-save "@asyncapi/parser@$asyncapi_parser") ||
            die "npm could not install @asyncapi/parser"
    fi
    if [ ! -x "$tools/venv/bin/schemathesis" ]; then
        say "installing schemathesis, openapi-spec-validator and jsonschema into $tools/venv (pip)"
        python3 -m venv "$tools/venv"
        "$tools/venv/bin/pip" install -q schemathesis==4.32.5 openapi-spec-validator==0.9.0 jsonschema==4.26.0 ||
            die "pip could not install the validators"
    fi
}

static_checks() {
    echo "== AsyncAPI: docs/asyncapi.json by @asyncapi/parser"
    # Run from the tools' directory, where node resolves the package.
    (cd "$tools" && node --input-type=module -e '
import { Parser, fromFile } from "@asyncapi/parser";
const { document, diagnostics } = await fromFile(new Parser(), process.argv[1]).parse();
const names = ["error", "warning", "info", "hint"];
for (const d of diagnostics) {
  if (d.severity <= 1) console.log(`${names[d.severity]} ${d.code}: ${d.message} at ${d.path.join(".")}`);
}
process.exit(document && !diagnostics.some((d) => d.severity === 0) ? 0 : 1);
' "$root/docs/asyncapi.json") || die "docs/asyncapi.json is not a valid AsyncAPI document"

    echo "== OpenAPI: docs/openapi.json by openapi-spec-validator"
    "$tools/venv/bin/openapi-spec-validator" docs/openapi.json || die "docs/openapi.json is not a valid OpenAPI document"

    echo "== JSON Schema: each schema against its draft's metaschema"
    "$tools/venv/bin/python" - docs/schemas/*.json <<'EOF' || die "a JSON Schema is not valid"
import json, sys
from jsonschema.validators import validator_for
bad = 0
for path in sys.argv[1:]:
    schema = json.load(open(path))
    if "$schema" not in schema:
        print(f"{path}: names no $schema draft"); bad += 1; continue
    cls = validator_for(schema, default=None)
    if cls is None:
        print(f"{path}: unknown draft {schema['$schema']}"); bad += 1; continue
    try:
        cls.check_schema(schema)
        print(f"{path}: valid {cls.__name__}")
    except Exception as e:
        print(f"{path}: {e}"); bad += 1
sys.exit(1 if bad else 0)
EOF
}

# The fenced block after `<!-- first-order: NAME -->` in FILE.
block() {
    awk -v marker="<!-- first-order: $2 -->" '
        $0 == marker { want = 1; next }
        want && /^```/ { if (inside) exit; inside = 1; next }
        inside { print }
    ' "$1"
}

suite_pid=""
suite_log=""
# shellcheck disable=SC2317  # reached through the EXIT trap
suite_down() {
    if [ -n "$suite_pid" ] && kill -0 "$suite_pid" 2>/dev/null; then
        say "stopping the suite (run-local, pid $suite_pid)"
        kill -TERM "$suite_pid" 2>/dev/null || true
        local deadline=$((SECONDS + 90))
        while kill -0 "$suite_pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
        kill -KILL "$suite_pid" 2>/dev/null || true
    fi
    suite_pid=""
}

suite_up() {
    suite_log="$root/target/check-docs-run-local.log"
    say "starting the suite (scripts/run-local.sh, log $suite_log)"
    SAS_KEEP_RUNNING=1 DEMO_ORDERS=${DEMO_ORDERS:-3} scripts/run-local.sh >"$suite_log" 2>&1 &
    suite_pid=$!
    trap suite_down EXIT
    local deadline=$((SECONDS + ${SUITE_TIMEOUT:-600}))
    until grep -q "the suite keeps running" "$suite_log"; do
        kill -0 "$suite_pid" 2>/dev/null || {
            tail -n 30 "$suite_log" >&2
            die "run-local exited before the suite was up"
        }
        ((SECONDS < deadline)) || {
            tail -n 30 "$suite_log" >&2
            die "the suite was not up within ${SUITE_TIMEOUT:-600}s"
        }
        sleep 1
    done
    say "the suite is up"
}

# first_order NAME FILE: runs the block marked NAME in FILE (bounded) and
# checks that its order ended processed.
first_order() {
    local name=$1 file=$2 code out
    code=$(block "$file" "$name")
    [ -n "$code" ] || die "$file has no block marked first-order: $name"
    echo "== first order: $name ($file)"
    case "$name" in
    sasctl | http)
        # The README names run-local's release binaries; CI may give others.
        code=${code//target\/release\//$bin_dir/}
        out=$(timeout 120 bash -euo pipefail -c "$code" 2>&1) || die "$name block failed: $out"
        ;;
    rust)
        out=$(timeout 300 cargo run -q -p sas-client --example first_order 2>&1) ||
            die "the Rust first order failed: $out"
        ;;
    python)
        out=$(timeout 120 "$python" -c "$code" 2>&1) || die "the Python first order failed: $out"
        ;;
    esac
    echo "$out" | tail -n 3
    case "$name" in
    sasctl) grep -q '"state":"processed"' <<<"$out" ;;
    http) grep -q 'processed' <<<"$out" ;;
    rust) grep -q ' processed: ' <<<"$out" ;;
    python) grep -q '^processed ' <<<"$out" ;;
    esac || die "the $name first order did not end processed"
}

live_checks() {
    bin_dir=${SAS_BIN_DIR:-target/release}
    python=${SAS_TEST_PYTHON:-$root/target/sas-python/bin/python}
    [ -x "$python" ] || die "no Python with the client at $python: run scripts/test.sh once, or set SAS_TEST_PYTHON"
    command -v jq >/dev/null || die "jq is needed (apt-get install -y jq)"
    suite_up
    for name in sasctl rust python http; do
        first_order "$name" README.md
    done
    first_order sasctl docs/getting-started.md

    echo "== Schemathesis: docs/openapi.json against the live HTTP API"
    "$tools/venv/bin/schemathesis" run docs/openapi.json \
        --url http://127.0.0.1:9101 \
        --checks not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance \
        --max-time "${SCHEMATHESIS_MAX_TIME:-60}" \
        --request-timeout 10 \
        --workers 1 ||
        die "Schemathesis found failures"
    suite_down
}

tools_up
case "$what" in
static) static_checks ;;
live) live_checks ;;
all)
    static_checks
    live_checks
    ;;
esac
say "all passed"
