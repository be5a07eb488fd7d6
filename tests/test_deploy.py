"""deploy/: the systemd units, the container image, compose and Kubernetes manifests, checked
for the relations that matter in production (drain time inside the stop timeout, probes on the
right endpoints and port, secrets from files, non-root), plus `systemd-analyze verify`."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from relay.settings import SECRET_OPTIONS, parse_duration

yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
UNIT = DEPLOY / "systemd" / "ledger-relay@.service"
MIGRATE_UNIT = DEPLOY / "systemd" / "ledger-relay-migrate.service"
HARDENING = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "CapabilityBoundingSet": "",
    "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
    "SystemCallFilter": "@system-service",
    "DynamicUser": "yes",
}


def unit_sections(path: Path) -> dict[str, list[tuple[str, str]]]:
    """systemd's format: sections of key=value lines; keys may repeat."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        assert current is not None, line
        key, _, value = line.partition("=")
        current.append((key.strip(), value.strip()))
    return sections


def values(section: list[tuple[str, str]], key: str) -> list[str]:
    return [v for k, v in section if k == key]


def systemd_seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(ms|s|sec|min|m|h)?", text)
    assert m, text
    factor = {"ms": 0.001, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600, None: 1}
    return float(m.group(1)) * factor[m.group(2)]


def env_assignments(section: list[tuple[str, str]]) -> dict[str, str]:
    out = {}
    for value in values(section, "Environment"):
        key, _, v = value.partition("=")
        out[key] = v
    return out


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


# -- systemd ----------------------------------------------------------------------------------


def test_systemd_template_unit_relations() -> None:
    s = unit_sections(UNIT)
    svc = s["Service"]
    assert values(svc, "Type") == ["notify"]
    assert values(svc, "NotifyAccess") == ["main"]
    assert values(svc, "Restart") == ["on-failure"]
    assert systemd_seconds(values(svc, "WatchdogSec")[0]) > 0
    env = env_assignments(svc)
    drain = parse_duration(env["RELAY_SHUTDOWN_TIMEOUT"])
    assert systemd_seconds(values(svc, "TimeoutStopSec")[0]) > drain
    assert "%i" in env["RELAY_REPLICA_ID"]  # each instance its own lease owner name
    files = values(svc, "EnvironmentFile")
    assert any("%i" in f for f in files) and any("%i" not in f for f in files)
    # Secrets are credentials named like the options the relay reads from
    # $CREDENTIALS_DIRECTORY, never Environment= lines.
    creds = [v.split(":", 1)[0] for v in values(svc, "LoadCredential")]
    assert "database_url" in creds and set(creds) <= SECRET_OPTIONS
    assert not any(k.removeprefix("RELAY_").lower() in SECRET_OPTIONS for k in env)
    for key, want in HARDENING.items():
        assert want in values(svc, key), key
    assert values(svc, "ExecStart")[0].endswith("relay run")
    assert "ledger-relay-migrate.service" in " ".join(values(s["Unit"], "After"))


def test_systemd_migrate_unit() -> None:
    svc = unit_sections(MIGRATE_UNIT)["Service"]
    assert values(svc, "Type") == ["oneshot"]
    assert values(svc, "ExecStart")[0].endswith("relay migrate")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    """The units as shipped, but for the path of the `relay` binary (verify insists it exists):
    here the test environment's."""
    relay_bin = Path(sys.executable).parent / "relay"
    if not relay_bin.exists():
        pytest.skip("the relay entry point is not installed")
    for src in (UNIT, MIGRATE_UNIT):
        text = src.read_text().replace("/opt/ledger-relay/bin/relay", str(relay_bin))
        (tmp_path / src.name).write_text(text)
    (tmp_path / "ledger-relay@1.service").symlink_to(tmp_path / UNIT.name)
    got = subprocess.run(
        [
            "systemd-analyze",
            "verify",
            str(tmp_path / "ledger-relay@1.service"),
            str(tmp_path / MIGRATE_UNIT.name),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # Unknown keys and unparsable values are only warnings to systemd: none is allowed here.
    assert got.returncode == 0 and got.stderr.strip() == "", got.stderr


# -- container --------------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile() -> None:
    lines = dockerfile()
    stages = [rest for word, rest in lines if word == "FROM"]
    assert len(stages) >= 2, "multi-stage: build tools stay out of the runtime image"
    final = lines[max(i for i, (w, _) in enumerate(lines) if w == "FROM") :]
    user = [rest for word, rest in final if word == "USER"]
    assert user and re.fullmatch(r"[1-9]\d*(:\d+)?", user[-1]), "a numeric non-root user"
    entry = [rest for word, rest in final if word == "ENTRYPOINT"]
    assert entry and entry[0].startswith("["), "exec form: relay is PID 1 and gets SIGTERM"
    env = " ".join(rest for word, rest in final if word == "ENV")
    assert "PYTHONUNBUFFERED=1" in env
    assert ("STOPSIGNAL", "SIGTERM") in final
    assert not re.search(r"RELAY_(DATABASE_URL|INGRESS_TOKEN|SIGNING_SECRET)=", env)
    port = re.search(r"RELAY_METRICS_ADDR=\S*:(\d+)", env)
    assert port and f"EXPOSE {port.group(1)}" in [f"{w} {r}" for w, r in final]


def test_compose() -> None:
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = doc["services"]
    assert {"postgres", "relay", "sink", "migrate"} <= set(services)
    relay = services["relay"]
    assert relay["deploy"]["replicas"] == 3
    env = relay["environment"]
    assert "RELAY_DATABASE_URL" not in env and "RELAY_DATABASE_URL_FILE" in env
    drain = parse_duration(env["RELAY_SHUTDOWN_TIMEOUT"])
    assert parse_duration(relay["stop_grace_period"]) > drain
    assert relay["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["migrate"]["command"] == ["migrate"]
    assert services["sink"]["command"][0] == "sink"
    assert "sink:" in env["RELAY_INGRESS_URL"] and "{run_id}" in env["RELAY_INGRESS_URL"]
    for secret in doc["secrets"].values():
        example = DEPLOY / (secret["file"] + ".example")
        assert example.exists(), example


# -- Kubernetes -------------------------------------------------------------------------------


def k8s_objects() -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for obj in load_all(path):
            out[obj["kind"]] = obj
    return out


def test_kubernetes_manifests() -> None:
    objs = k8s_objects()
    dep = objs["Deployment"]
    spec = dep["spec"]
    assert spec["replicas"] >= 2
    pod = spec["template"]["spec"]
    (relay,) = [c for c in pod["containers"] if c["name"] == "relay"]
    env = {e["name"]: e for e in relay["env"]}
    drain = parse_duration(env["RELAY_SHUTDOWN_TIMEOUT"]["value"])
    assert pod["terminationGracePeriodSeconds"] > drain
    # Probes on the relay's own endpoints, on the port metrics_addr listens on.
    assert relay["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert relay["readinessProbe"]["httpGet"]["path"] == "/readyz"
    ports = {p["name"]: p["containerPort"] for p in relay["ports"]}
    metrics_port = int(env["RELAY_METRICS_ADDR"]["value"].rpartition(":")[2])
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert ports[relay[probe]["httpGet"]["port"]] == metrics_port
    # Secrets come from the Secret, as files; no secret value in the manifest's env.
    for name, e in env.items():
        assert name.removeprefix("RELAY_").lower() not in SECRET_OPTIONS, name
        assert "postgresql://" not in str(e.get("value", ""))
    secret_volumes = [v for v in pod["volumes"] if "secret" in v]
    assert secret_volumes[0]["secret"]["secretName"] == objs["Secret"]["metadata"]["name"]
    assert env["RELAY_DATABASE_URL_FILE"]["value"].startswith(relay["volumeMounts"][0]["mountPath"])
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert relay["securityContext"]["allowPrivilegeEscalation"] is False
    # Upgrades: the schema is migrated before a new pod's relay starts.
    assert pod["initContainers"][0]["args"] == ["migrate"]
    # The disruption budget covers these pods.
    pdb = objs["PodDisruptionBudget"]
    labels = spec["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert spec["selector"]["matchLabels"].items() <= labels.items()


def test_image_user_matches_kubernetes_user() -> None:
    user = [rest for word, rest in dockerfile() if word == "USER"][-1]
    pod = k8s_objects()["Deployment"]["spec"]["template"]["spec"]
    assert int(user.split(":")[0]) == pod["securityContext"]["runAsUser"]
