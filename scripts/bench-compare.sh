#!/usr/bin/env bash
# Compares this checkout's sas with another git revision's, back to back:
# builds that revision's release binaries in a worktree of its own
# (.bench/compare/<rev>/src; every revision shares one target directory,
# .bench/compare/target, and keeps its binaries in .bench/compare/<rev>/bin),
# then alternates runs of the harness on the two
# builds (A = the revision, B = this checkout) so that the machine's drift
# falls on both alike, and prints each run's throughput, CPU per order (sas,
# Postgres, RabbitMQ and the remote) and low-load latency, and the medians per build. Peers, the machine's limit and the recovery run
# are skipped; the low-load runs offer both builds the same rate.
#
#   scripts/bench-compare.sh <git-rev> [pairs] [harness options...]
#   scripts/bench-compare.sh 437ede7 3 --orders-one 6000
#   scripts/bench-compare.sh fa03836 2 --skip-http --skip-fanout   # a revision before #41 and #43
#
# With SAS_COMPARE_B_ENV="KEY=VALUE ..." the B runs give sas's services
# those settings too (--sas-env); with the revision `self`, A is this
# checkout's build as well: one build, with and without the settings.
#   SAS_COMPARE_B_ENV=SAS__BROKER__STEP_MESSAGES=transient scripts/bench-compare.sh self 2
# With SAS_COMPARE_B_REV=<rev>, B is that revision's build (to bisect):
#   SAS_COMPARE_B_REV=b0d1168 scripts/bench-compare.sh fa03836 2 --skip-http --skip-fanout
set -euo pipefail
# A failed build inside $(built ...) stops the script too.
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

rev="${1:?usage: scripts/bench-compare.sh <git-rev> [pairs] [harness options...]}"
pairs="${2:-3}"
shift $(( $# >= 2 ? 2 : 1 ))

target="${CARGO_TARGET_DIR:-target}"
# The whole workspace, as scripts/run-local.sh builds it: a -p subset unifies
# the dependencies' features otherwise and rebuilds most of the tree.
cargo build --release --workspace
services=(submission scheduler agent supervisor remote-sim)

# The release binaries of revision $1, built once in a worktree of its own;
# every revision shares one target directory, so that only sas's own
# crates are built again per revision. Prints the binaries' directory.
built() {
    local short base
    short="$(git rev-parse --short "$1")"
    base="$PWD/.bench/compare/$short"
    if [ ! -x "$base/bin/remote-sim" ]; then
        [ -d "$base/src" ] || git worktree add --detach "$base/src" "$1" >/dev/null
        (cd "$base/src" && CARGO_TARGET_DIR="$PWD/../../target" cargo build --release --workspace) >&2
        mkdir -p "$base/bin"
        for s in "${services[@]}"; do cp ".bench/compare/target/release/$s" "$base/bin/"; done
    fi
    echo "$base/bin"
}

if [ "$rev" = self ]; then
    a_bins="$target/release"
else
    a_bins="$(built "$rev")"
fi
# SAS_COMPARE_B_REV=<rev>: B is that revision's build, not this checkout's
# (to bisect: both ends are revisions).
if [ -n "${SAS_COMPARE_B_REV:-}" ]; then
    b_bins="$(built "$SAS_COMPARE_B_REV")"
else
    b_bins="$target/release"
fi
b_env=()
for kv in ${SAS_COMPARE_B_ENV:-}; do
    b_env+=(--sas-env "$kv")
done

out=".bench/compare/out"
mkdir -p "$out"
common=(--quick --skip-peers --skip-limits --skip-floor --skip-recovery --skip-hops)
# Sizes the caller did not give (the harness refuses an option twice).
for default in "--low-rate 100" "--orders-one 6000" "--orders-three 3000" \
    "--scaled-orders 3000" "--low-orders 600" "--low-max-secs 15"; do
    case " $* " in
        *" ${default%% *} "*) ;;
        *) common+=($default) ;;
    esac
done
common+=("$@")
for i in $(seq 1 "$pairs"); do
    "$target/release/sas-bench" --bin-dir "$a_bins" --out "$out/A-$i.json" "${common[@]}"
    "$target/release/sas-bench" --bin-dir "$b_bins" --out "$out/B-$i.json" "${common[@]}" ${b_env[@]+"${b_env[@]}"}
done

python3 - "$out" "$pairs" "$rev" "${SAS_COMPARE_B_REV:-this checkout}" <<'PY'
import json, statistics, sys
out, pairs, rev, b = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
rows = {}
for build in "AB":
    for i in range(1, pairs + 1):
        report = json.load(open(f"{out}/{build}-{i}.json"))
        for proc, mib in report.get("memory_mib", {}).items():
            rows.setdefault(("peak RSS", proc, "", "run"), {"A": [], "B": []})[build].append(mib)
        for run in report["sas"]:
            r = run["result"]
            key = (run["deployment"], r["workflow"], r["status_events"], run["load"])
            value = r["throughput"] if run["load"] == "full" else r["latency_ms"]["p50"]
            rows.setdefault(key, {"A": [], "B": []})[build].append(value)
            if run["load"] == "full":
                # sas's processes, Postgres, RabbitMQ and the remote; not
                # `other` (whatever else the machine ran).
                cpu = sum(v for k, v in r.get("cpu_ms_per_order", {}).items() if k != "other")
                rows.setdefault(key[:3] + ("full cpu",), {"A": [], "B": []})[build].append(cpu)
print(f"A = {rev}, B = {b}; {pairs} alternating runs each")
print("| deployment | workflow | events | load | measure | A runs | B runs | A median | B median | B/A |")
print("|---|---|---|---|---|---|---|--:|--:|--:|")
for (dep, wf, events, load), v in sorted(rows.items()):
    what = {"full": "orders/s", "full cpu": "CPU ms/order", "run": "MiB"}.get(load, "p50 ms")
    a, b = statistics.median(v["A"]), statistics.median(v["B"])
    fmt = lambda xs: ", ".join(f"{x:.1f}" for x in xs)
    print(f"| {dep} | {wf} | {events} | {load} | {what} | {fmt(v['A'])} | {fmt(v['B'])} | {a:.1f} | {b:.1f} | {b / a:.3f} |")
PY
