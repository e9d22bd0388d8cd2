"""The Kubernetes manifests (deploy/kubernetes) validate against the schemas of a pinned
Kubernetes version (kubernetes-validate, strict: no field the API would drop), and say what
a node's tierd needs: the settings it reads exist, probes, the metrics port, secrets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.settings import Settings

yaml = pytest.importorskip("yaml", reason="PyYAML comes with the test extra")
kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the test extra)")

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
#: The Kubernetes version the manifests are checked against (a release clusters run now).
VERSION = "1.33.0"


def _documents() -> list[tuple[str, dict[str, Any]]]:
    kustomization = yaml.safe_load((ROOT / "kustomization.yaml").read_text())
    out = []
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((ROOT / name).read_text()):
            if doc:
                out.append((name, doc))
    return out


def test_every_manifest_validates_strictly() -> None:
    docs = _documents()
    assert {d["kind"] for _, d in docs} == {
        "Namespace",
        "ConfigMap",
        "Secret",
        "DaemonSet",
        "Service",
    }
    for name, doc in docs:
        try:
            kv.validate(doc, VERSION, strict=True)
        except kv.ValidationError as exc:  # pragma: no cover - the message is the point
            pytest.fail(f"{name}: {exc.message} at {list(exc.path)}")


def test_a_wrong_field_is_caught() -> None:
    ((_, ds),) = [(n, d) for n, d in _documents() if d["kind"] == "DaemonSet"]
    ds["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(ds, VERSION, strict=True)


def test_the_daemonset_wires_what_tierd_reads() -> None:
    (ds,) = [d for _, d in _documents() if d["kind"] == "DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    env = {e["name"]: e for e in c["env"]}
    settings = {f"TIERD_{n.upper()}" for n in Settings.model_fields}
    for name in env:
        if name.startswith("TIERD_"):
            assert name in settings, f"{name} is no setting tierd reads"
    for secret in ("TIERD_ADMIN_TOKEN", "TIERD_DATA_TOKEN", "TIERD_FLEET_TOKEN"):
        assert "secretKeyRef" in env[secret]["valueFrom"], secret
    assert env["TIERD_ADVERTISE_URL"]["value"] == "http://$(POD_IP):8470"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
    assert spec["hostIPC"] is True and env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    config = next(d for _, d in _documents() if d["kind"] == "ConfigMap")
    toml = config["data"]["tierd.toml"]
    for path in ("/nvme", "/ssd"):
        assert path in mounts and f'path = "{path}"' in toml
    (svc,) = [d for _, d in _documents() if d["kind"] == "Service"]
    assert svc["spec"]["ports"][0]["name"] == "http"  # a ServiceMonitor's port


def test_the_config_is_one_tierd_accepts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = next(d for _, d in _documents() if d["kind"] == "ConfigMap")
    path = tmp_path / "tierd.toml"
    path.write_text(config["data"]["tierd.toml"])
    from app.settings import get_settings

    monkeypatch.setenv("TIERD_ADMIN_TOKEN", "a" * 32)
    s = get_settings(path)
    assert [t.name for t in s.tiers] == ["nvme", "ssd", "s3"]


def test_the_daemonset_takes_no_gpu_from_the_device_plugin() -> None:
    # tierd sees every GPU of its node through the runtime (NVIDIA_VISIBLE_DEVICES=all); a
    # nvidia.com/gpu request would take them from the engines it serves (daemonset.yaml).
    (ds,) = [d for _, d in _documents() if d["kind"] == "DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "nvidia"
    for c in spec["containers"] + spec["initContainers"]:
        for kind in ("requests", "limits"):
            assert "nvidia.com/gpu" not in c.get("resources", {}).get(kind, {}), c["name"]


def test_the_service_monitor_scrapes_the_service() -> None:
    # Not a kustomization resource (its kind exists only with the Prometheus Operator's CRDs).
    kustomization = yaml.safe_load((ROOT / "kustomization.yaml").read_text())
    assert "servicemonitor.yaml" not in kustomization["resources"]
    sm = yaml.safe_load((ROOT / "servicemonitor.yaml").read_text())
    (svc,) = [d for _, d in _documents() if d["kind"] == "Service"]
    assert sm["kind"] == "ServiceMonitor" and sm["metadata"]["namespace"] == "tierd"
    labels = svc["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    ports = {p["name"] for p in svc["spec"]["ports"]}
    assert [(e["port"], e["path"]) for e in sm["spec"]["endpoints"]] == [("http", "/metrics")]
    assert "http" in ports
