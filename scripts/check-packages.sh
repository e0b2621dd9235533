#!/usr/bin/env bash
# The clients as a registry would get them (#55):
# - the crates sas-protocol and sas-client: `cargo publish --dry-run` of
#   both together (cargo packages sas-protocol and resolves sas-client's
#   dependency on it through a local overlay), each built from its
#   package alone; any `warning:` (missing metadata, an unused manifest
#   key, a compiler warning) fails, but for cargo's "aborting upload due to
#   dry run";
# - the Python client (clients/python): its wheel and sdist built from a
#   copy of the directory (nothing is written into clients/python) into
#   target/packages/python, both checked for the licence files, then the
#   wheel installed into a fresh venv and imported.
#
#   scripts/check-packages.sh
#   SAS_PACKAGES_ALLOW_DIRTY=1 scripts/check-packages.sh   # uncommitted changes too
#
# Needs cargo, python3 with venv, crates.io and PyPI. Everything goes under
# target/packages; the venv holding `build` is made once and reused.
# Exit 1 on any problem.
set -euo pipefail
cd "$(dirname "$0")/.."

out=target/packages
py_out=$out/python
mkdir -p "$out"

fail() {
    echo "check-packages: $*" >&2
    exit 1
}

echo "== Rust: cargo publish --dry-run -p sas-protocol -p sas-client"
publish=(cargo publish --dry-run -p sas-protocol -p sas-client)
if [ "${SAS_PACKAGES_ALLOW_DIRTY:-}" = 1 ]; then
    publish+=(--allow-dirty)
fi
log=$out/cargo-publish.log
if ! "${publish[@]}" >"$log" 2>&1; then
    cat "$log"
    if grep -q -- '--allow-dirty' "$log"; then
        echo "(SAS_PACKAGES_ALLOW_DIRTY=1 packages uncommitted changes too)" >&2
    fi
    fail "${publish[*]} failed (above; the whole output in $log)"
fi
# The steps, without a line per dependency compiled.
grep -Ev '^ +(Compiling|Checking|Downloading|Downloaded|Blocking) ' "$log" || true
warnings=$(grep -E '^warning' "$log" | grep -Fv 'warning: aborting upload due to dry run' || true)
if [ -n "$warnings" ]; then
    fail "cargo publish --dry-run warned (the whole output in $log):
$warnings"
fi

echo "== Python: wheel and sdist of clients/python into $py_out"
build_venv=$out/venv-build
if ! "$build_venv/bin/python" -c 'import build' >/dev/null 2>&1; then
    rm -rf "$build_venv"
    python3 -m venv "$build_venv"
    "$build_venv/bin/pip" install --quiet --disable-pip-version-check build
fi
src=$out/python-src
rm -rf "$src" "$py_out"
mkdir -p "$src" "$py_out"
# A copy without what a local `pip install ./clients/python` or pytest left.
tar -C clients/python \
    --exclude=./build --exclude=./dist --exclude='*.egg-info' \
    --exclude=__pycache__ --exclude=.pytest_cache -cf - . | tar -C "$src" -xf -
log=$out/python-build.log
if ! "$build_venv/bin/python" -m build --sdist --wheel --outdir "$py_out" "$src" >"$log" 2>&1; then
    cat "$log"
    fail "python -m build failed (above)"
fi
rm -rf "$src"
wheels=("$py_out"/*.whl)
sdists=("$py_out"/*.tar.gz)
if [ "${#wheels[@]}" != 1 ] || [ ! -f "${wheels[0]}" ] || [ "${#sdists[@]}" != 1 ] || [ ! -f "${sdists[0]}" ]; then
    fail "expected one wheel and one sdist in $py_out"
fi
echo "built ${wheels[0]##*/} and ${sdists[0]##*/}"

echo "== Python: the licence files in the wheel and the sdist"
"$build_venv/bin/python" - "${wheels[0]}" "${sdists[0]}" <<'EOF'
import sys, tarfile, zipfile

wheel, sdist = sys.argv[1:]
licences = ("LICENSE-APACHE", "LICENSE-MIT")
with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
missing = [l for l in licences if not any(n.endswith(".dist-info/licenses/" + l) for n in names)]
with tarfile.open(sdist) as t:
    names = t.getnames()
missing += [l + " (sdist)" for l in licences if not any(n.count("/") == 1 and n.endswith("/" + l) for n in names)]
if missing:
    sys.exit("check-packages: missing " + ", ".join(missing))
print("both hold " + " and ".join(licences))
EOF

echo "== Python: the wheel installed into a fresh venv and imported"
install_venv=$out/venv-install
rm -rf "$install_venv"
python3 -m venv "$install_venv"
"$install_venv/bin/pip" install --quiet --disable-pip-version-check "${wheels[0]}"
# From elsewhere and without PYTHONPATH, so that only the installed copy can
# be imported.
python=$PWD/$install_venv/bin/python
installed=$(cd / && env -u PYTHONPATH "$python" -c '
import sas_saga_client
print(sas_saga_client.__version__, sas_saga_client.__file__)')
case "$installed" in
    *"/$install_venv/"*) echo "sas_saga_client $installed" ;;
    *) fail "sas_saga_client was imported from elsewhere: $installed" ;;
esac

echo "== packages checked in ${SECONDS}s"
