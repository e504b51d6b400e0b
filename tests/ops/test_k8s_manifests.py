"""The KubeRay manifests validate offline (core objects against Kubernetes' schemas, the RayService and the
PodMonitor against k8s/schemas, serveConfigV2 args through service.config.ServiceConfig), and a broken copy
of each part fails with a message that names the broken field."""
import shutil

import pytest
import yaml

from _ops import REPO, load

validate = load("k8s/validate.py", "k8s_validate")


def _by_kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def _serve_args(rayservice) -> dict:
    cfg = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    (app,) = [a for a in cfg["applications"] if a["import_path"] == validate.SERVICE_IMPORT_PATH]
    return app["args"]


def test_base_and_overlays_validate():
    targets = validate.default_targets()
    assert {t.name for t in targets} == {"base", "cpu-demo", "gpu"}
    rendered = {t.name: validate.validate_dir(t) for t in targets}

    from diffkv_serve.service.config import ServiceConfig

    demo = rendered["cpu-demo"]
    (rs,) = _by_kind(demo, "RayService")
    cfg = ServiceConfig.model_validate(_serve_args(rs))
    engine = cfg.engine
    assert engine.device == "cpu" and engine.model is None and engine.cache.kv_mode == "diffkv"  # the embedded model
    # node failure: two CPU worker pods, one engine replica each; the ingress on the head; re-sends on
    (group,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert group["groupName"] == "cpu" and group["minReplicas"] == group["replicas"] == 2
    assert validate.offered_resources(group) == {"diffkv_engine": 1.0} and cfg.rank_resources == {"diffkv_engine": 1}
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert set(cfg.ingress_resources) <= set(validate.offered_resources(head))
    assert cfg.num_replicas == 2 and cfg.retry.max_retries >= 1
    assert "nvidia.com/gpu" not in yaml.safe_dump(rs)
    assert len(_by_kind(demo, "PodMonitor")) == 1

    gpu = rendered["gpu"]
    (rs,) = _by_kind(gpu, "RayService")
    cfg = ServiceConfig.model_validate(_serve_args(rs))
    engine = cfg.engine
    assert engine.tensor_parallel_size == 2 and engine.device == "cuda" and engine.model.startswith("/models/")
    (group,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert group["minReplicas"] == 2 and cfg.num_replicas == 2 and cfg.retry.max_retries >= 1
    for _, template in validate.pod_templates(rs):
        assert all("readinessProbe" in c and "livenessProbe" in c for c in template["spec"]["containers"])
    container = group["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    (pvc,) = _by_kind(gpu, "PersistentVolumeClaim")
    assert {"name": "models", "persistentVolumeClaim": {"claimName": pvc["metadata"]["name"], "readOnly": True}} \
        in group["template"]["spec"]["volumes"]
    assert rs["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    assert all(o["metadata"].get("namespace") == "diffkv" for o in gpu if o["kind"] != "Namespace")


def test_cli_passes_on_the_repo(capsys):
    assert validate.main([]) == 0
    assert capsys.readouterr().out.count("ok ") == 3


# (file under k8s/, text to replace, replacement, overlay to render, words the error must contain)
BROKEN = [
    pytest.param("overlays/gpu/rayservice-patch.yaml", "      kv_mode: diffkv", "      kv_mod: diffkv", "gpu",
                 ["args", "kv_mod", "Extra inputs"], id="serve-arg-typo"),
    pytest.param("overlays/gpu/rayservice-patch.yaml", "tensor_parallel_size: 2", "tensor_parallel_size: two",
                 "gpu", ["args", "tensor_parallel_size"], id="serve-arg-type"),
    pytest.param("overlays/cpu-demo/rayservice-patch.yaml", "kv_mode: diffkv", "kv_mode: k2v2", "cpu-demo",
                 ["args", "kv_mode"], id="serve-arg-value"),
    pytest.param("overlays/gpu/rayservice-patch.yaml", "route_prefix: /", "route_prefx: /", "gpu",
                 ["applications[0]", "route_prefx"], id="serve-config-key"),
    pytest.param("overlays/cpu-demo/rayservice-patch.yaml", "diffkv_serve.service.app:build_app", "diffkv_serve.service.app:build_ap",
                 "cpu-demo", ["import_path", "build_ap"], id="import-path"),
    pytest.param("overlays/gpu/rayservice-patch.yaml", "name: EngineReplica", "name: EngineReplika", "gpu",
                 ["deployments[0].name", "EngineReplika"], id="serve-deployment-name"),
    pytest.param("overlays/gpu/rayservice-patch.yaml", 'nvidia.com/gpu: "2"', 'nvidia.com/gpu: "1"', "gpu",
                 ["tensor_parallel_size=2", "nvidia.com/gpu"], id="tp-without-gpus"),
    pytest.param("base/rayservice.yaml", "  upgradeStrategy:", "  upgradeStrategey:", "cpu-demo",
                 ["rayservice.schema.json", "upgradeStrategey"], id="rayservice-field"),
    pytest.param("base/rayservice.yaml", 'num-cpus: "1"', "num-cpus: 1", "gpu",
                 ["rayservice.schema.json", "rayStartParams"], id="raystartparams-not-string"),
    # node failure: one replica left, replicas sharing a pod, one pod, no re-sends, no probe, no ingress host
    pytest.param("overlays/gpu/rayservice-patch.yaml", "num_replicas: 2", "num_replicas: 1", "gpu",
                 ["1 engine replica(s)", "num_replicas"], id="single-replica"),
    pytest.param("overlays/cpu-demo/rayservice-patch.yaml", '{\\"diffkv_engine\\": 1}', '{\\"diffkv_engine\\": 2}',
                 "cpu-demo", ["room for 2 engine replicas", "workerGroupSpecs(cpu)"], id="replicas-share-a-pod"),
    pytest.param("overlays/gpu/rayservice-patch.yaml", "workerGroupSpecs/0/minReplicas\n  value: 2",
                 "workerGroupSpecs/0/minReplicas\n  value: 1", "gpu", ["1 worker pod(s)"], id="one-worker-pod"),
    pytest.param("overlays/cpu-demo/rayservice-patch.yaml", "max_retries: 1", "max_retries: 0", "cpu-demo",
                 ["retry.max_retries is 0"], id="no-retry"),
    pytest.param("overlays/gpu/rayservice-patch.yaml", "ingress_resources: {diffkv_ingress: 1}",
                 "ingress_resources: {diffkv_ingres: 1}", "gpu", ["ingress_resources", "diffkv_ingres"],
                 id="ingress-resource-not-offered"),
    pytest.param("base/rayservice.yaml", "                readinessProbe:", "                startupProbe:", "gpu",
                 ["workerGroupSpecs[0](gpu)", "no readinessProbe"], id="worker-probe-missing"),
    pytest.param("base/rayservice.yaml", "- name: dashboard", "- nam: dashboard", "cpu-demo",
                 ["headGroupSpec.template", "'nam'"], id="pod-template-field"),
    pytest.param("base/rayservice.yaml", "terminationGracePeriodSeconds: 60", "terminationGracePeriodSeconds: 1m",
                 "gpu", ["workerGroupSpecs[0](gpu).template", "terminationGracePeriodSeconds"],
                 id="pod-template-type"),
    # API keys: only from a Secret, on the pod that hosts the ingress
    pytest.param("base/rayservice.yaml", "                - name: DIFFKV_API_KEY", "                - name: DIFFKV_KEY",
                 "cpu-demo", ["headGroupSpec container 'ray-head'", "DIFFKV_API_KEY", "secretKeyRef"],
                 id="api-key-not-from-secret"),
    pytest.param("base/rayservice.yaml", "                  valueFrom:\n                    secretKeyRef:\n"
                 "                      name: diffkv-api-key\n                      key: api-key\n"
                 "                      optional: true", '                  value: "sk-in-the-manifest"', "gpu",
                 ["literal value", "DIFFKV_API_KEY"], id="api-key-literal"),
    # drain: the head drains before it stops, with time for it
    pytest.param("base/rayservice.yaml", "          terminationGracePeriodSeconds: 45",
                 "          terminationGracePeriodSeconds: 35", "gpu",
                 ["terminationGracePeriodSeconds is 35", "at least 40"], id="drain-grace-too-short"),
    pytest.param("base/rayservice.yaml", '"diffkv_serve.service.cli", "drain", "--address", "auto"]',
                 '"diffkv_serve.service.cli", "serve", "--address", "auto"]', "cpu-demo", ["preStop", "drain"],
                 id="head-does-not-drain"),
    pytest.param("overlays/gpu/models-pvc.yaml", "  accessModes:", "  accessMode:", "gpu",
                 ["PersistentVolumeClaim/diffkv-models", "accessMode"], id="core-object-field"),
    pytest.param("components/monitoring/podmonitor.yaml", "      path: /metrics", "      pth: /metrics",
                 "cpu-demo", ["podmonitor.schema.json", "pth"], id="podmonitor-field"),
    pytest.param("components/monitoring/podmonitor.yaml", "    - port: metrics", "    - port: metric", "gpu",
                 ["PodMonitor/diffkv-serve", "'metric'"], id="podmonitor-port"),
]


@pytest.mark.parametrize("relpath,old,new,overlay,words", BROKEN)
def test_broken_copy_fails(tmp_path, relpath, old, new, overlay, words):
    k8s = tmp_path / "k8s"
    shutil.copytree(REPO / "k8s", k8s)
    path = k8s / relpath
    text = path.read_text()
    assert text.count(old) >= 1, f"{old!r} not in {relpath}"
    path.write_text(text.replace(old, new))
    target = k8s / "overlays" / overlay
    with pytest.raises(validate.ManifestError) as e:
        validate.validate_dir(target)
    for w in words:
        assert w in str(e.value), f"{w!r} not in:\n{e.value}"
