#!/usr/bin/env bash
# Static checks of the deployment files: the Kubernetes manifests of
# deploy/kubernetes (each entry point rendered, then validated strictly
# against the Kubernetes schemas of kubernetes-validate, and checked for
# sas's own rules: grace periods, probes, the KEDA queues, placeholder
# secrets) and docker-compose.yml. See scripts/check_deploy.py for the list.
#
#   scripts/check-deploy.sh                      # Kubernetes 1.37 (the default)
#   K8S_VERSIONS="1.33 1.37" scripts/check-deploy.sh
#   scripts/check-deploy.sh --renderer builtin   # without kubectl's kustomize
#
# Needs python3 (3.11+) and PyPI, once: the validator is installed into
# .bench/venv-k8s (ignored by git) and reused. Exit 1 on any problem.
set -euo pipefail
cd "$(dirname "$0")/.."

validator_version=1.37.0
venv=.bench/venv-k8s

if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c "
import sys
from kubernetes_validate.version import __version__ as v
sys.exit(v != '$validator_version')" 2>/dev/null; then
    echo "installing kubernetes-validate==$validator_version into $venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "kubernetes-validate==$validator_version"
fi

versions=()
for v in ${K8S_VERSIONS:-1.37}; do versions+=(-k "$v"); done
exec "$venv/bin/python" scripts/check_deploy.py "${versions[@]}" "$@"
