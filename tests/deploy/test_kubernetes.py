"""deploy/kubernetes: a base (the Deployment, its disruption budget, the PodMonitor) and one
directory per destination adding its ConfigMap. The manifests parse, validate against
Kubernetes' own schemas, and hold the properties relayd needs (probes, a locked-down pod, a
grace period above the drain, secret files where each destination's configuration names
them)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from relayd.settings import load_settings
from relayd.sinks.registry import kinds
from tests.deploy.conftest import DEPLOY
from tests.deploy.dockerfile import final
from tests.support import clear_relayd_env

MANIFESTS = DEPLOY / "kubernetes"
BASE = MANIFESTS / "base"
# One directory per destination: the kinds of the sink registry.
DESTINATIONS = sorted(kinds())
# relayd/daemon/lifecycle.py: settling after the grace period takes at most this.
SETTLE_BOUND_S = 10
# Kinds whose schema ships with Kubernetes; the PodMonitor is a CRD of the Prometheus
# Operator, and the Kustomization is kustomize's own file: their properties are tested below.
BUILT_IN = {"ConfigMap", "Deployment", "PodDisruptionBudget"}


def _load(directory: Path) -> dict[str, dict[str, Any]]:
    """The manifests of one directory by kind (one object of each kind)."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(directory.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            assert document["kind"] not in found, f"two {document['kind']}s"
            found[document["kind"]] = document
    return found


def _documents(destination: str = "ojs") -> dict[str, dict[str, Any]]:
    """What `kubectl apply -k deploy/kubernetes/<destination>` applies, by kind (its own
    Kustomization's)."""
    overlay = _load(MANIFESTS / destination)
    base = _load(BASE)
    del base["Kustomization"]
    assert not overlay.keys() & base.keys() - {"Kustomization"}
    return base | overlay


def _deployment() -> dict[str, Any]:
    return _documents()["Deployment"]


def _pod() -> dict[str, Any]:
    pod: dict[str, Any] = _deployment()["spec"]["template"]["spec"]
    return pod


def _container() -> dict[str, Any]:
    [container] = _pod()["containers"]
    assert isinstance(container, dict)
    return container


def _config_toml(destination: str = "ojs") -> dict[str, Any]:
    return tomllib.loads(_documents(destination)["ConfigMap"]["data"]["config.toml"])


def test_base_and_destinations_parse_and_their_kustomizations_list_them() -> None:
    """Each file is YAML; the base's kustomization.yaml names its other files; each
    destination's names the base and its own ConfigMap; every directory is one of those."""
    base = _load(BASE)
    assert set(base) == {"Deployment", "PodDisruptionBudget", "PodMonitor", "Kustomization"}
    files = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(base["Kustomization"]["resources"]) == files
    assert {p.name for p in MANIFESTS.iterdir()} == {"base", *DESTINATIONS}
    for destination in DESTINATIONS:
        documents = _documents(destination)
        assert set(documents) == BUILT_IN | {"PodMonitor", "Kustomization"}
        assert documents["Kustomization"]["resources"] == ["../base", "configmap.yaml"]


@pytest.mark.parametrize("destination", DESTINATIONS)
@pytest.mark.parametrize("kind", sorted(BUILT_IN))
def test_manifest_matches_the_kubernetes_schema(kind: str, destination: str) -> None:
    """Strict validation against the schemas kubernetes-validate ships (no network)."""
    version = kubernetes_validate.latest_version()
    kubernetes_validate.validate(_documents(destination)[kind], version, strict=True)


def test_two_replicas_with_health_and_readiness_probes() -> None:
    """Liveness on /healthz, readiness on /readyz (unready, never killed, while the breaker
    is open or the database unreachable), both on the metrics port."""
    assert _deployment()["spec"]["replicas"] == 2
    container = _container()
    [port] = container["ports"]
    assert (port["name"], port["containerPort"]) == ("metrics", 9464)
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"


def test_http_listens_beyond_loopback_for_the_kubelet() -> None:
    """The probes come to the pod's IP: http.listen is 0.0.0.0 on the metrics port."""
    env = {item["name"]: item["value"] for item in _container()["env"]}
    assert env["RELAYD_HTTP__LISTEN"] == "0.0.0.0:9464"


def test_pod_is_locked_down_as_the_image_user() -> None:
    """Non-root as the Dockerfile's numeric user, read-only root, no capabilities, no
    privilege escalation, RuntimeDefault seccomp; /tmp is an emptyDir."""
    [user] = [d.arguments for d in final("USER")]
    uid, _, gid = user.partition(":")
    pod, container = _pod()["securityContext"], _container()["securityContext"]
    assert pod["runAsNonRoot"] is True
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    assert (container["runAsUser"], container["runAsGroup"]) == (int(uid), int(gid))
    assert container["runAsNonRoot"] is True
    assert container["readOnlyRootFilesystem"] is True
    assert container["allowPrivilegeEscalation"] is False
    assert container["capabilities"] == {"drop": ["ALL"]}
    assert container["seccompProfile"] == {"type": "RuntimeDefault"}
    mounts = {m["mountPath"]: m["name"] for m in _container()["volumeMounts"]}
    volumes = {v["name"]: v for v in _pod()["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]  # noqa: S108 - the pod's /tmp, not ours


def test_termination_grace_outlasts_the_drain() -> None:
    """terminationGracePeriodSeconds > relay.shutdown_grace_s + the settle bound."""
    grace = _config_toml().get("relay", {}).get("shutdown_grace_s", 10.0)
    assert _pod()["terminationGracePeriodSeconds"] > grace + SETTLE_BOUND_S


@pytest.mark.parametrize("destination", DESTINATIONS)
def test_secrets_are_files_of_a_secret_named_by_the_config(
    destination: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every *_file key of a destination's config.toml is a file of the mounted Secret (or
    the ConfigMap), its kustomization.yaml says how to create each, and the config.toml is
    a valid relayd configuration of that kind."""
    documents = _documents(destination)
    config = _config_toml(destination)
    mounts = {m["name"]: m["mountPath"] for m in _container()["volumeMounts"]}
    volumes = {v["name"]: v for v in _pod()["volumes"]}
    assert volumes["secrets"]["secret"]["secretName"] == "relayd"
    assert volumes["config"]["configMap"]["name"] == documents["ConfigMap"]["metadata"]["name"]
    assert mounts["config"] == "/etc/relayd"
    files = {
        (section, key): value
        for section, values in config.items()
        for key, value in values.items()
        if key.endswith("_file")
    }
    assert ("database", "dsn_file") in files
    assert config["sink"]["kind"] == destination
    howto = (MANIFESTS / destination / "kustomization.yaml").read_text()
    text = documents["ConfigMap"]["data"]["config.toml"]
    for number, path in enumerate(files.values()):
        directory, _, name = path.rpartition("/")
        assert directory == mounts["secrets"], path
        assert f"--from-file={name}=" in howto, f"{destination}: how to create {name}"
        # The file as relayd reads it, standing in the test directory.
        stand_in = tmp_path / name
        stand_in.write_text(_SECRET_TEXT.get(name, f"secret-{number}"))
        text = text.replace(path, str(stand_in))
    (tmp_path / "config.toml").write_text(text)
    clear_relayd_env(monkeypatch)
    settings = load_settings(tmp_path / "config.toml")
    assert settings.sink.kind == destination


# What each secret file must look like to load (a DSN, a webhook secret, a creds file).
_SECRET_TEXT = {
    "database-dsn": "postgresql://relayd@db:5432/app",
    "webhook-secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\n",
    "nats.creds": (
        "-----BEGIN NATS USER JWT-----\neyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5In0.e30.c2ln\n"
        "------END NATS USER JWT------\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        "SUAGMJH5XLGZKQQWAWKRZJIGMOU4HPFUYLXJMXOO5NLFEO2OOQJ5LPRDPM\n"
        "------END USER NKEY SEED------\n"
    ),
}


def test_pod_monitor_scrapes_the_pods_as_job_relayd() -> None:
    """The PodMonitor selects the pods, scrapes the metrics port, and names the job
    "relayd" (what deploy/prometheus/relayd.rules.yml selects)."""
    monitor = _documents()["PodMonitor"]["spec"]
    labels = _deployment()["spec"]["template"]["metadata"]["labels"]
    assert monitor["selector"]["matchLabels"].items() <= labels.items()
    [endpoint] = monitor["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
    assert labels[monitor["jobLabel"]] == "relayd"
    assert 'job="relayd"' in (DEPLOY / "prometheus" / "relayd.rules.yml").read_text()


def test_disruption_budget_keeps_one_relay() -> None:
    """The PodDisruptionBudget selects the pods and keeps one of the two replicas."""
    budget = _documents()["PodDisruptionBudget"]["spec"]
    labels = _deployment()["spec"]["template"]["metadata"]["labels"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()
    assert 1 <= budget["minAvailable"] < _deployment()["spec"]["replicas"]
