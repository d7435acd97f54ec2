"""The Kubernetes manifests (deploy/k8s): every overlay renders with kubectl's
kustomize, each object validates against the Kubernetes API schemas (the
cert-manager ones against what cert-manager requires), the pods are locked
down and probed without certificates, and each rendered process's
configuration passes `kvstore config check` with its command line's roles.
No cluster runs here: docs/operations.md says what was not run."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvstore.checks import check_roles
from kvstore.config import load
from kvstore.security import create_dev_certificates

ROOT = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
OVERLAYS = ["single-node", "scale-out"]
#: The Kubernetes API the objects are checked against.
K8S_VERSION = "1.31.0"


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("kubectl is not installed (it is on this kind of machine)")
        pytest.skip("kubectl is not installed")
    return found


def render(overlay: str | Path) -> list[dict[str, Any]]:
    done = subprocess.run(
        [kubectl(), "kustomize", str(overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def pods(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ("StatefulSet", "Deployment")]


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(ROOT / "overlays" / request.param)


def test_every_object_validates(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    issuers = {o["metadata"]["name"] for o in objects if o["kind"] == "Issuer"}
    for obj in objects:
        if obj["apiVersion"] == "cert-manager.io/v1":
            _check_cert_manager(obj, issuers)
            continue
        # strict: a misspelt field is an error, not ignored.
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        assert obj["metadata"].get("namespace", "kvstore") == "kvstore"


def test_a_misspelt_field_is_caught() -> None:
    # The check above can fail: a typo in a probe is refused.
    (workload,) = [
        o for o in render(ROOT / "overlays" / "single-node") if o["kind"] == "StatefulSet"
    ]
    broken = copy.deepcopy(workload)
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def _check_cert_manager(obj: dict[str, Any], issuers: set[str]) -> None:
    """What cert-manager's v1 API requires of the fields used here."""
    kind, spec = obj["kind"], obj["spec"]
    if kind == "Issuer":
        assert set(spec) in ({"selfSigned"}, {"ca"}), spec
        if "ca" in spec:
            assert spec["ca"]["secretName"]
        return
    assert kind == "Certificate", kind
    assert spec["secretName"] and spec["issuerRef"]["kind"] == "Issuer"
    assert spec["issuerRef"]["name"] in issuers  # issued by one rendered here
    allowed = {"server auth", "client auth", "digital signature", "key encipherment"}
    assert set(spec.get("usages", [])) <= allowed
    assert spec["privateKey"]["algorithm"] in ("RSA", "ECDSA", "Ed25519")
    if not spec.get("isCA"):
        assert spec.get("dnsNames") or spec.get("uris"), obj["metadata"]["name"]


def test_pods_are_locked_down_and_probed_without_a_certificate(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, objects = rendered
    assert pods(objects)
    for workload in pods(objects):
        spec = workload["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsUser"] == 10001
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["automountServiceAccountToken"] is False
        for container in containers(workload):
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["readOnlyRootFilesystem"] is True
            assert context["capabilities"]["drop"] == ["ALL"]
            assert container["resources"]["requests"] and container["resources"]["limits"]
        (server,) = spec["containers"]
        health = next(p["containerPort"] for p in server["ports"] if p["name"] == "health")
        for probe, path in (
            ("livenessProbe", "/healthz"),
            ("startupProbe", "/healthz"),
            ("readinessProbe", "/readyz"),
        ):
            assert server[probe]["httpGet"] == {"path": path, "port": "health"}
        assert health == 8081
    budgets = {o["metadata"]["name"] for o in objects if o["kind"] == "PodDisruptionBudget"}
    assert "kvstore" in budgets


def test_each_process_passes_config_check_with_its_roles(
    rendered: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    overlay, objects = rendered
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap"]
    files: dict[str, str] = config_map["data"]
    checked = 0
    for workload in pods(objects):
        spec = workload["spec"]["template"]["spec"]
        (server,) = spec["containers"]
        args = server["args"]
        path, roles = args[args.index("--config") + 1], args[args.index("--roles") + 1]
        if path.startswith("/run/kvstore/"):
            # Written by the init container from the template, with the pod's name.
            (init,) = spec["initContainers"]
            assert "holder.toml" in init["command"][-1]
            text = files["holder.toml"].replace("POD_NAME", "kvstore-0")
        else:
            text = files[Path(path).name]
        mounts = [m["mountPath"] for m in server["volumeMounts"]]
        root = tmp_path / workload["metadata"]["name"]
        config = _materialize(root, text, files["policy.json"], mounts)
        problems = check_roles(load(config, environ={}), tuple(roles.split(",")))
        assert problems == [], f"{overlay} {workload['metadata']['name']}: {problems}"
        checked += 1
    assert checked == len(pods(objects))


def _materialize(root: Path, text: str, policy: str, mounts: list[str]) -> Path:
    """The configuration with its absolute paths under ``root``, and the files
    it names there: what the pod's volumes hold (cert-manager's Secrets,
    the key, the ConfigMap). Each file it names is under one of ``mounts``."""
    certs = root / "certs"
    create_dev_certificates(certs, ["holder", "pc"])
    named = {
        "/etc/kvstore/tls/tls.crt": certs / "server.pem",
        "/etc/kvstore/tls/tls.key": certs / "server.key",
        "/etc/kvstore/tls/ca.crt": certs / "ca.pem",
        "/etc/kvstore/clients/holder/tls.crt": certs / "client-holder.pem",
        "/etc/kvstore/clients/holder/tls.key": certs / "client-holder.key",
        "/etc/kvstore/clients/pc/tls.crt": certs / "client-pc.pem",
        "/etc/kvstore/clients/pc/tls.key": certs / "client-pc.key",
    }
    for line in text.splitlines():
        value = line.partition("=")[2].split("#")[0].strip().strip('"')
        if value.startswith("/"):
            assert any(value.startswith(m.rstrip("/") + "/") for m in mounts), (
                f"{value} is on no volume the container mounts"
            )
            target = root / value.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            if value in named:
                shutil.copy(named[value], target)
            elif value.endswith("storage.key"):
                target.write_bytes(os.urandom(32))
            elif value.endswith("policy.json"):
                target.write_text(policy)
    config = root / "kvstore.toml"
    config.write_text(text.replace('"/', f'"{root}/'))
    return config
