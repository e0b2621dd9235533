"""Static checks of the deployment files, run by scripts/check-deploy.sh
(which provides the virtualenv with kubernetes-validate and PyYAML).

For each kustomize entry point of deploy/kubernetes (the default, demo/,
with-keda/), the rendered objects must:
- validate strictly (unknown fields fail) against the Kubernetes schemas of
  kubernetes-validate, for every version asked; a kind with no schema fails,
  except KEDA's objects, which are checked here instead: each trigger of the
  ScaledObject reads an agent's request queue of the ConfigMap's sas.toml
  (<broker.prefix>.agent.<name>.requests, core/src/topology.rs) and takes
  the broker URL from an env variable of the container it scales;
- give every Deployment a terminationGracePeriodSeconds above the
  shutdown.grace of sas.toml (10s when unset), so the kubelet never kills a
  service still handing its work back;
- probe only /readyz and /healthz, and give every sas container (one with
  SAS_CONFIG) readiness on /readyz, liveness on /healthz and
  SAS__HTTP__HOST=0.0.0.0;
- not make a program refuse its configuration for want of a dashboard token
  (each one checks [dashboard]), nor run the dashboard with no login.
The placeholder Secret must hold only REPLACE_ME values, and
docker-compose.yml must parse (with a dashboard token, and be refused
without one), its services' stop_grace_period above the grace of
config/demo.toml.

Rendering uses `kubectl kustomize` when kubectl is installed, else a small
renderer of the kustomize features these files use (resources, namespace,
labels, images, configMapGenerator files, secretGenerator envs, components,
and JSON 6902 patches by kind and name).

Exit status 1 with one line per problem.
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import kubernetes_validate
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, ValidationError
from kubernetes_validate.version import __version__ as VALIDATOR_VERSION

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
ENTRY_POINTS = [DEPLOY, DEPLOY / "demo", DEPLOY / "with-keda"]
PROBE_PATHS = {"/readyz", "/healthz"}
DEFAULT_GRACE_S = 10.0
# Kubernetes' own default when a pod does not say.
DEFAULT_TERMINATION_GRACE_S = 30

problems: list[str] = []


def problem(where: str, what: str) -> None:
    problems.append(f"{where}: {what}")


# --------------------------------------------------------------------------
# Durations as sas reads them (humantime): "10s", "500ms", "1m 30s".

UNITS = {
    "ms": 0.001, "msec": 0.001,
    "s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1,
    "m": 60, "min": 60, "mins": 60, "minute": 60, "minutes": 60,
    "h": 3600, "hr": 3600, "hrs": 3600, "hour": 3600, "hours": 3600,
    "d": 86400, "day": 86400, "days": 86400,
}


def seconds(text: str) -> float:
    parts = re.findall(r"(\d+)\s*([a-z]+)", text.strip())
    rest = re.sub(r"(\d+)\s*([a-z]+)", "", text.strip()).strip()
    if not parts or rest or any(unit not in UNITS for _, unit in parts):
        raise ValueError(f"not a duration: {text!r}")
    return sum(int(n) * UNITS[unit] for n, unit in parts)


# --------------------------------------------------------------------------
# Rendering.


def render(entry: Path, renderer: str) -> list[dict]:
    if renderer == "kubectl":
        out = subprocess.run(
            ["kubectl", "kustomize", str(entry)],
            capture_output=True, text=True,
        )
        if out.returncode != 0:
            problem(rel(entry), f"kubectl kustomize failed: {out.stderr.strip()}")
            return []
        return [d for d in yaml.safe_load_all(out.stdout) if d]
    return MiniKustomize().build(entry)


class MiniKustomize:
    """The kustomize features deploy/kubernetes uses, for a machine without kubectl."""

    def build(self, directory: Path) -> list[dict]:
        k = yaml.safe_load((directory / "kustomization.yaml").read_text())
        objects: list[dict] = []
        for item in k.get("resources", []):
            path = directory / item
            if path.is_dir():
                objects += self.build(path)
            else:
                objects += [d for d in yaml.safe_load_all(path.read_text()) if d]
        for component in k.get("components", []):
            # A component's resources join the overlay's, and its patches
            # apply to all of them.
            objects += self.build(directory / component)
            c = yaml.safe_load((directory / component / "kustomization.yaml").read_text())
            self.patch(objects, c.get("patches", []))
        self.patch(objects, k.get("patches", []))
        for gen in k.get("configMapGenerator", []):
            data = {}
            for f in gen.get("files", []):
                data[Path(f).name] = (directory / f).read_text()
            objects.append({"apiVersion": "v1", "kind": "ConfigMap",
                            "metadata": {"name": gen["name"]}, "data": data})
        for gen in k.get("secretGenerator", []):
            data = {}
            for f in gen.get("envs", []):
                for key, value in env_file(directory / f).items():
                    data[key] = base64.b64encode(value.encode()).decode()
            objects.append({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                            "metadata": {"name": gen["name"]}, "data": data})
        if "namespace" in k:
            for o in objects:
                if o["kind"] != "Namespace":
                    o["metadata"]["namespace"] = k["namespace"]
        for label in k.get("labels", []):
            for o in objects:
                o["metadata"].setdefault("labels", {}).update(label["pairs"])
                template = o.get("spec", {}).get("template")
                if label.get("includeTemplates") and template:
                    template.setdefault("metadata", {}).setdefault("labels", {}).update(label["pairs"])
        for image in k.get("images", []):
            for c in all_containers(objects):
                if c.get("image", "").split(":")[0] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image.get('newTag', 'latest')}"
        return objects


    @staticmethod
    def patch(objects: list[dict], patches: list[dict]) -> None:
        for p in patches:
            target = p["target"]
            for o in objects:
                if o["kind"] != target.get("kind", o["kind"]) or \
                        o["metadata"]["name"] != target.get("name", o["metadata"]["name"]):
                    continue
                for op in yaml.safe_load(p["patch"]):
                    *parents, last = [s.replace("~1", "/").replace("~0", "~")
                                      for s in op["path"].split("/")[1:]]
                    node = o
                    for s in parents:
                        node = node[int(s)] if isinstance(node, list) else node[s]
                    if op["op"] == "remove":
                        del node[int(last) if isinstance(node, list) else last]
                    elif op["op"] in ("add", "replace"):
                        node[last] = op["value"]
                    else:
                        raise SystemExit(f"the built-in renderer cannot apply {op['op']!r}")


def env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key] = value
    return values


def all_containers(objects: list[dict]) -> list[dict]:
    out = []
    for o in objects:
        spec = o.get("spec", {}).get("template", {}).get("spec", {})
        out += spec.get("initContainers", []) + spec.get("containers", [])
    return out


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# --------------------------------------------------------------------------
# Checks.


def check_schemas(where: str, objects: list[dict], versions: list[str]) -> None:
    for o in objects:
        name = f"{o.get('kind')}/{o.get('metadata', {}).get('name')}"
        if str(o.get("apiVersion", "")).startswith("keda.sh/"):
            continue  # no built-in schema: check_keda
        for version in versions:
            try:
                kubernetes_validate.validate(o, version, strict=True)
            except ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                problem(where, f"{name} is not valid Kubernetes {version}: {path}: {e.message}")
            except SchemaNotFoundError as e:
                problem(where, f"{name}: {e.message}")


def sas_toml(where: str, objects: list[dict]) -> dict:
    maps = [o for o in objects if o["kind"] == "ConfigMap" and "sas.toml" in o.get("data", {})]
    if len(maps) != 1:
        problem(where, f"expected one ConfigMap with sas.toml, found {len(maps)}")
        return {}
    try:
        return tomllib.loads(maps[0]["data"]["sas.toml"])
    except tomllib.TOMLDecodeError as e:
        problem(where, f"sas.toml does not parse: {e}")
        return {}


def env_value(container: dict, name: str) -> str | None:
    for e in container.get("env", []):
        if e.get("name") == name:
            return e.get("value")
    return None


def check_deployments(where: str, objects: list[dict], config: dict) -> None:
    for o in objects:
        if o["kind"] != "Deployment":
            continue
        name = f"Deployment/{o['metadata']['name']}"
        pod = o["spec"]["template"]["spec"]
        termination = pod.get("terminationGracePeriodSeconds", DEFAULT_TERMINATION_GRACE_S)
        for c in pod.get("containers", []):
            sas = env_value(c, "SAS_CONFIG") is not None
            if sas:
                grace_text = env_value(c, "SAS__SHUTDOWN__GRACE") or \
                    config.get("shutdown", {}).get("grace")
                try:
                    grace = seconds(grace_text) if grace_text else DEFAULT_GRACE_S
                except ValueError as e:
                    problem(where, f"{name}: shutdown.grace: {e}")
                    grace = DEFAULT_GRACE_S
                if not termination > grace:
                    problem(where, f"{name}: terminationGracePeriodSeconds {termination} "
                                   f"must exceed shutdown.grace ({grace:g}s)")
                check_dashboard_auth(where, name, c, config)
                if env_value(c, "SAS__HTTP__HOST") != "0.0.0.0":
                    problem(where, f"{name}: container {c['name']} needs SAS__HTTP__HOST=0.0.0.0")
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                probe = c.get(kind)
                if probe is None:
                    if sas and kind != "startupProbe":
                        problem(where, f"{name}: container {c['name']} has no {kind}")
                    continue
                path = probe.get("httpGet", {}).get("path")
                if path not in PROBE_PATHS:
                    problem(where, f"{name}: {kind} of {c['name']} probes {path!r}, "
                                   f"not one of {sorted(PROBE_PATHS)}")
                want = {"readinessProbe": "/readyz", "livenessProbe": "/healthz"}.get(kind)
                if sas and want and path != want:
                    problem(where, f"{name}: {kind} of {c['name']} must probe {want}, not {path!r}")


def check_disruption_budgets(where: str, objects: list[dict]) -> None:
    """Every Deployment of more than one replica (or scaled by KEDA) has a
    PodDisruptionBudget that selects its pods, so a drain keeps it serving;
    and every sas container that reads the broker's queues gets its URL."""
    budgets = [o["spec"].get("selector", {}).get("matchLabels", {})
               for o in objects if o["kind"] == "PodDisruptionBudget"]
    for o in objects:
        if o["kind"] != "Deployment":
            continue
        name = f"Deployment/{o['metadata']['name']}"
        labels = o["spec"]["template"]["metadata"].get("labels", {})
        if o["spec"].get("replicas", 1) > 1 or "replicas" not in o["spec"]:
            if not any(b and all(labels.get(k) == v for k, v in b.items()) for b in budgets):
                problem(where, f"{name}: {o['spec'].get('replicas', 'scaled')} replicas and "
                               "no PodDisruptionBudget selects its pods")
        for c in o["spec"]["template"]["spec"].get("containers", []):
            envs = {e.get("name") for e in c.get("env", [])}
            if "SAS_CONFIG" in envs and "SAS__BROKER__URL" not in envs:
                problem(where, f"{name}: container {c['name']} has no SAS__BROKER__URL "
                               "(it would look for guest@127.0.0.1)")


def check_dashboard_auth(where: str, name: str, container: dict, config: dict) -> None:
    """Every sas program checks [dashboard] at start-up (exit 2 when bad), so a
    login that needs a token needs one in every container, not only the
    dashboard's; and the dashboard, listening on 0.0.0.0, must ask for one."""
    section = config.get("dashboard", {})
    auth = env_value(container, "SAS__DASHBOARD__AUTH") or section.get("auth", "none")
    has_token = bool(section.get("tokens") or section.get("token")) or any(
        e.get("name") == "SAS__DASHBOARD__TOKEN" for e in container.get("env", []))
    if auth == "token" and not has_token:
        problem(where, f"{name}: dashboard.auth is token for {container['name']}, which has "
                       "no token (set auth only in the dashboard's env, or give it the token)")
    if container.get("args", [None])[0] == "dashboard" and auth == "none":
        problem(where, f"{name}: the dashboard must not run with dashboard.auth = none "
                       "on 0.0.0.0 (set SAS__DASHBOARD__AUTH)")


def check_keda(where: str, objects: list[dict], config: dict) -> None:
    prefix = config.get("broker", {}).get("prefix", "sas")
    agents = set(config.get("agents", {}))
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    for o in objects:
        if not str(o.get("apiVersion", "")).startswith("keda.sh/"):
            continue
        name = f"{o['kind']}/{o['metadata'].get('name')}"
        if o["kind"] != "ScaledObject":
            problem(where, f"{name}: only ScaledObject is checked; add a check for this kind")
            continue
        spec = o.get("spec", {})
        target = deployments.get(spec.get("scaleTargetRef", {}).get("name"))
        if target is None:
            problem(where, f"{name}: scaleTargetRef names no Deployment of the render")
            continue
        if "replicas" in target["spec"]:
            problem(where, f"{name}: {target['metadata']['name']} keeps spec.replicas, "
                           "which every apply would reset under KEDA")
        envs = {e["name"] for c in target["spec"]["template"]["spec"]["containers"]
                for e in c.get("env", [])}
        triggers = spec.get("triggers") or []
        if not triggers:
            problem(where, f"{name}: no triggers")
        for t in triggers:
            meta = t.get("metadata", {})
            queue = meta.get("queueName", "")
            if t.get("type") != "rabbitmq":
                problem(where, f"{name}: trigger of type {t.get('type')!r}, expected rabbitmq")
            m = re.fullmatch(re.escape(prefix) + r"\.agent\.(.+)\.requests", queue)
            if not m or m.group(1) not in agents:
                problem(where, f"{name}: queue {queue!r} is not an agent's request queue "
                               f"({prefix}.agent.<one of {sorted(agents)}>.requests)")
            if meta.get("hostFromEnv") not in envs:
                problem(where, f"{name}: hostFromEnv {meta.get('hostFromEnv')!r} is not an env "
                               "variable of the target's containers")


def check_placeholder_secret() -> None:
    path = DEPLOY / "base" / "secrets.example.env"
    for key, value in env_file(path).items():
        if "REPLACE_ME" not in value:
            problem(rel(path), f"{key} must be a REPLACE_ME placeholder, never a real value")


def check_compose() -> None:
    where = "docker-compose.yml"
    if shutil.which("docker-compose"):
        # The dashboard's token is a required variable: the file is valid
        # with one, and without one compose must refuse it, naming it. No
        # .env of the checkout takes part (an empty --env-file instead).
        env = {k: v for k, v in os.environ.items() if k != "SAS_DASHBOARD_TOKEN"}
        with tempfile.NamedTemporaryFile(suffix=".env") as empty:
            config = ["docker-compose", "--env-file", empty.name, "-f", str(ROOT / where),
                      "config", "-q"]
            token = {"SAS_DASHBOARD_TOKEN": "check-deploy-placeholder"}
            out = subprocess.run(config, capture_output=True, text=True, cwd=ROOT,
                                 env={**env, **token})
            without = subprocess.run(config, capture_output=True, text=True, cwd=ROOT, env=env)
        if out.returncode != 0:
            problem(where, f"docker-compose config: {out.stderr.strip()}")
        else:
            print(f"ok   {where} (docker-compose config -q)")
        if without.returncode == 0 or "SAS_DASHBOARD_TOKEN" not in without.stderr:
            problem(where, "docker-compose config passes without SAS_DASHBOARD_TOKEN: the "
                           "dashboard's token must be required (${SAS_DASHBOARD_TOKEN:?...})")
        else:
            print(f"ok   {where}: refused without SAS_DASHBOARD_TOKEN")
    else:
        print(f"     {where}: docker-compose is not installed; parsing it instead")
    try:
        compose = yaml.safe_load((ROOT / where).read_text())
    except yaml.YAMLError as e:
        problem(where, f"does not parse: {e}")
        return
    grace_text = tomllib.loads((ROOT / "config" / "demo.toml").read_text()) \
        .get("shutdown", {}).get("grace")
    grace = seconds(grace_text) if grace_text else DEFAULT_GRACE_S
    services = compose.get("services") or {}
    if not services:
        problem(where, "no services")
    for name, service in services.items():
        command = service.get("command") or []
        if command[:1] not in (["submission"], ["scheduler"], ["agent"], ["supervisor"]):
            continue
        stop = service.get("stop_grace_period")
        if stop is None or not seconds(str(stop)) > grace:
            problem(where, f"{name}: stop_grace_period {stop!r} must exceed shutdown.grace ({grace:g}s)")
        if "healthcheck" not in service:
            problem(where, f"{name}: no healthcheck")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", "--kubernetes-version", action="append", dest="versions",
                        help="Kubernetes version to validate against (repeatable)")
    parser.add_argument("--renderer", choices=["auto", "kubectl", "builtin"], default="auto",
                        help="kubectl kustomize, the built-in renderer, or kubectl when installed")
    args = parser.parse_args()
    versions = args.versions or ["1.37.0"]
    renderer = args.renderer
    if renderer == "auto":
        renderer = "kubectl" if shutil.which("kubectl") else "builtin"
    print(f"kubernetes-validate {VALIDATOR_VERSION} against {', '.join(versions)} (strict); rendering with {renderer}")
    for entry in ENTRY_POINTS:
        where = rel(entry)
        before = len(problems)
        objects = render(entry, renderer)
        if not objects:
            problem(where, "renders nothing")
            continue
        config = sas_toml(where, objects)
        check_schemas(where, objects, versions)
        check_deployments(where, objects, config)
        check_keda(where, objects, config)
        check_disruption_budgets(where, objects)
        if len(problems) == before:
            kinds = sorted({o["kind"] for o in objects})
            print(f"ok   {where}: {len(objects)} objects ({', '.join(kinds)})")
    check_placeholder_secret()
    check_compose()
    for p in problems:
        print(f"FAIL {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
