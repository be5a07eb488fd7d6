"""deploy/: the systemd units, the container image, compose and Kubernetes manifests, checked
for the relations that matter in production (drain time inside the stop timeout, probes on the
right endpoints and port, secrets from files, non-root), plus `systemd-analyze verify`."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from relay.serving.server import MAX_CONNECTIONS
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


# What a stop may take before the manager's SIGKILL: the drain (shutdown_timeout), the spans'
# bounded flush after it (relay/edges/tracing.py flush_timeout), and a few seconds for handing the
# leases back and closing the pools.
HAND_BACK = 5.0


def stop_budget(drain: float) -> float:
    from relay.edges.tracing import flush_timeout

    return drain + flush_timeout(drain) + HAND_BACK


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
    assert systemd_seconds(values(svc, "TimeoutStopSec")[0]) > stop_budget(drain)
    assert "%i" in env["RELAY_REPLICA_ID"]  # each instance its own lease owner name
    files = values(svc, "EnvironmentFile")
    assert any("%i" in f for f in files) and any("%i" not in f for f in files)
    # Secrets are credentials named like the options the relay reads from
    # $CREDENTIALS_DIRECTORY, never Environment= lines.
    creds = [credential_id(v) for v in values(svc, "LoadCredential")]
    assert "database_url" in creds and set(creds) <= SECRET_OPTIONS
    assert not any(k.removeprefix("RELAY_").lower() in SECRET_OPTIONS for k in env)
    for key, want in HARDENING.items():
        assert want in values(svc, key), key
    # Descriptors well above what metrics_addr may hold (issue 32: 1,024 idle clients ended it).
    assert int(values(svc, "LimitNOFILE")[0]) >= 16 * MAX_CONNECTIONS
    assert values(svc, "ExecStart")[0].endswith("relay run")
    assert "ledger-relay-migrate.service" in " ".join(values(s["Unit"], "After"))


def test_systemd_migrate_unit() -> None:
    svc = unit_sections(MIGRATE_UNIT)["Service"]
    assert values(svc, "Type") == ["oneshot"]
    assert "/opt/ledger-relay/bin/relay migrate" in values(svc, "ExecStart")[0]
    # `relay migrate` gets the first of these the store holds (test_systemd_migrate_url).
    creds = [credential_id(v) for v in values(svc, "LoadCredential")]
    assert creds == list(MIGRATE_URLS)
    assert start_failing_credentials(svc) == []
    # As hardened as the relay's unit (issue 15).
    for key, want in {**HARDENING, **MIGRATE_HARDENING}.items():
        assert want in values(svc, key), key
    assert any(v.startswith("~") and "@privileged" in v for v in values(svc, "SystemCallFilter"))


MIGRATE_HARDENING = {"ProtectClock": "yes", "ProtectProc": "invisible", "LockPersonality": "yes"}
# The migration's URL, first found first (docs/operations.md §5): its own (direct, the schema
# owner's role), else the relay's direct LISTEN URL, else the relay's URL.
MIGRATE_URLS = {
    "migrate_database_url": "postgresql://owner:pw@pg-direct:5432/relay",
    "listen_database_url": "postgresql://relay:pw@pg-direct:5432/relay",
    "database_url": "postgresql://relay:pw@pgbouncer:6432/relay",
}


def exec_start(unit: Path, relay: Path, credentials: Path) -> list[str]:
    """The unit's ExecStart= as systemd runs it: `%d` is $CREDENTIALS_DIRECTORY, `$$` a `$`
    (systemd.unit(5), systemd.service(5) "Command lines"), the relay at `relay`."""
    (line,) = values(unit_sections(unit)["Service"], "ExecStart")
    line = line.replace("/opt/ledger-relay/bin/relay", str(relay))
    words = [w.replace("%d", str(credentials)).replace("$$", "$") for w in shlex.split(line)]
    assert not any(re.search(r"%[a-zA-Z]|\$\{?[A-Za-z]", w) for w in words[:1]), words
    return words


def migrate_url_through_the_unit(tmp_path: Path, stored: dict[str, str]) -> str | None:
    """The database URL `relay migrate` reads when ledger-relay-migrate.service runs with
    the credentials `stored` (id -> URL): its ExecStart run for real, the relay replaced by a
    stand-in that reads the URL with the relay's own code (relay/cli.py _database_url)."""
    creds = tmp_path / "credentials"
    creds.mkdir()
    for cred, url in stored.items():
        (creds / cred).write_text(url + "\n")
    stand_in = tmp_path / "relay"
    stand_in.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        "from relay.settings import option_value\n"
        "assert sys.argv[1:] == ['migrate'], sys.argv\n"
        "url = option_value('database_url', {}, os.environ)\n"
        "print('' if url is None else url.reveal())\n"
    )
    stand_in.chmod(0o755)
    env = {
        "PATH": "/usr/bin:/bin",
        "CREDENTIALS_DIRECTORY": str(creds),
        "PYTHONPATH": str(DEPLOY.parent),
    }
    got = subprocess.run(
        exec_start(MIGRATE_UNIT, stand_in, creds),
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=True,
    )
    return got.stdout.strip() or None


@pytest.mark.parametrize(
    "stored",
    [
        ["database_url"],
        ["listen_database_url", "database_url"],
        ["migrate_database_url", "listen_database_url", "database_url"],
        ["migrate_database_url", "database_url"],
        [],
    ],
)
def test_systemd_migrate_url(tmp_path: Path, stored: list[str]) -> None:
    """Issue 49 item 9: the migration must not go through PgBouncer (docs/operations.md §3),
    yet the unit loaded only database_url, which on a PgBouncer site is the pooled URL. It
    takes the first credential of MIGRATE_URLS the store holds; with none, the relay's own
    "database_url: required" (exit 2)."""
    got = migrate_url_through_the_unit(tmp_path, {c: MIGRATE_URLS[c] for c in stored})
    want = next((MIGRATE_URLS[c] for c in MIGRATE_URLS if c in stored), None)
    assert got == want


# Every secret docs/operations.md §5 lists as a credential: all of the relay's secrets.
DOCUMENTED_CREDENTIALS = {
    "database_url",
    "ingress_token",
    "signing_secret",
    "listen_database_url",
    "ui_token",
    "ingress_proxy",
}


def credential_id(value: str) -> str:
    """The ID of a `LoadCredential=ID[:PATH]` value."""
    return value.split(":", 1)[0]


def start_failing_credentials(svc: list[tuple[str, str]]) -> list[str]:
    """The credentials whose source, when missing, fails the unit's start (systemd.exec(5),
    "CREDENTIALS"): an absolute PATH that does not exist is fatal unless a `SetCredential=` of
    the same ID stands in for it; a relative PATH (or none) names a credential looked up in the
    service manager's own and in /etc/credstore/, /run/credstore/, /usr/lib/credstore/, and
    one found nowhere is skipped."""
    defaults = {credential_id(v) for v in values(svc, "SetCredential")}
    fatal = []
    for value in values(svc, "LoadCredential"):
        cred, _, path = value.partition(":")
        if path.startswith("/") and cred not in defaults:
            fatal.append(cred)
    return fatal


def test_systemd_units_load_every_documented_credential() -> None:
    svc = unit_sections(UNIT)["Service"]
    creds = {credential_id(v) for v in values(svc, "LoadCredential")}
    assert creds == DOCUMENTED_CREDENTIALS == SECRET_OPTIONS
    ops = (DEPLOY.parent / "docs" / "operations.md").read_text()
    for name in DOCUMENTED_CREDENTIALS:
        assert f"`{name}`" in ops, name


def test_systemd_credentials_a_site_does_not_use_do_not_fail_the_start() -> None:
    """A site without a signing secret (or a ui_token, or a separate LISTEN URL) starts the unit
    as shipped: no credential line whose missing source is fatal to systemd (issue 41: each
    missing file failed the start with 243/CREDENTIALS). Each comes from systemd's credential
    store under the relay's own prefix, so no other service's credential is picked up."""
    for unit in (UNIT, MIGRATE_UNIT):
        svc = unit_sections(unit)["Service"]
        assert start_failing_credentials(svc) == [], unit.name
        for value in values(svc, "LoadCredential"):
            cred, _, path = value.partition(":")
            assert path == f"ledger-relay.{cred}", value
    # The check sees the shipped mistake: an absolute path with no fallback.
    planted = [("LoadCredential", "signing_secret:/etc/ledger-relay/credentials/signing_secret")]
    assert start_failing_credentials(planted) == ["signing_secret"]
    assert start_failing_credentials([*planted, ("SetCredential", "signing_secret:")]) == []


def test_systemd_does_not_restart_a_configuration_error(tmp_path: Path) -> None:
    """`relay run` exits 2 on a configuration error and 3 on a schema mismatch: no restart
    fixes either, so the unit must not restart on them (issue 41: a configuration error
    restarted five times, until the start limit). The code is `relay run`'s own, read from a
    real run with a setting missing, as systemd would see it."""
    svc = unit_sections(UNIT)["Service"]
    prevented = {int(code) for v in values(svc, "RestartPreventExitStatus") for code in v.split()}
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CREDENTIALS_DIRECTORY": str(tmp_path)}
    got = subprocess.run(
        [str(Path(sys.executable).parent / "relay"), "run"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert got.returncode == 2, got.stderr
    assert "database_url" in got.stderr
    assert {got.returncode, 3} <= prevented


def test_env_files_use_no_unit_specifiers() -> None:
    """systemd expands %i, %H, ... in unit files, never in an EnvironmentFile."""
    for path in sorted((DEPLOY / "systemd").glob("*.env.example")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not re.search(r"%[a-zA-Z%]", line), f"{path.name}:{n}: {line}"


def test_systemd_units_say_what_to_edit_for_verify() -> None:
    """Issue 49 item 9: the shipped ExecStart path fails `systemd-analyze verify` until the
    relay is installed there or the path edited: each unit says so where it says what to edit,
    just above its first Exec line, and every Exec line names the path."""
    for unit in (UNIT, MIGRATE_UNIT):
        svc = unit_sections(unit)["Service"]
        execs = [v for k, v in svc if k.startswith("Exec")]
        assert execs and all("/opt/ledger-relay/bin/relay" in v for v in execs), unit.name
        lines = unit.read_text().splitlines()
        at = next(n for n, line in enumerate(lines) if line.startswith("Exec"))
        comment = []
        for line in reversed(lines[:at]):
            if not line.startswith("#"):
                break
            comment.insert(0, line.lstrip("# "))
        said = " ".join(comment)
        assert "What to edit" in said and "/opt/ledger-relay/bin/relay" in said, unit.name
        assert "systemd-analyze verify" in said and "not executable" in said, unit.name


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
@pytest.mark.skipif(Path("/opt/ledger-relay/bin/relay").exists(), reason="the relay is there")
def test_systemd_analyze_verify_fails_until_the_path_is_edited(tmp_path: Path) -> None:
    """What the units' comment says is what systemd says."""
    for src in (UNIT, MIGRATE_UNIT):
        (tmp_path / src.name).write_text(src.read_text())
    (tmp_path / "ledger-relay@1.service").symlink_to(tmp_path / UNIT.name)
    for name in ("ledger-relay@1.service", MIGRATE_UNIT.name):
        got = subprocess.run(
            ["systemd-analyze", "verify", str(tmp_path / name)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert got.returncode != 0, name
        assert "Command /opt/ledger-relay/bin/relay is not executable" in got.stderr, got.stderr


def systemd_run_recipe() -> list[str]:
    """The `systemd-run` command docs/operations.md gives for the operator commands."""
    ops = (DEPLOY.parent / "docs" / "operations.md").read_text()
    m = re.search(r"```sh\n(\s*sudo systemd-run .*?)```", ops, re.DOTALL)
    assert m, "no systemd-run recipe in docs/operations.md"
    return shlex.split(m.group(1).replace("\\\n", " "))


def test_the_credential_store_recipe_runs_the_cli_like_the_units() -> None:
    """Issue 49 item 9: `relay status` / `retry` on a host whose URL is only in the root-only
    credential store. The documented `systemd-run` gives the command the unit's credential,
    settings file and binary, waits and pipes its output."""
    words = systemd_run_recipe()
    assert words[:2] == ["sudo", "systemd-run"]
    assert {"--pipe", "--wait"} <= set(words)
    props = [words[i + 1] for i, w in enumerate(words) if w == "-p"]
    svc = unit_sections(UNIT)["Service"]
    unit_url = next(v for v in values(svc, "LoadCredential") if credential_id(v) == "database_url")
    assert f"LoadCredential={unit_url}" in props
    shared_env = next(f for f in values(svc, "EnvironmentFile") if "%i" not in f)
    assert f"EnvironmentFile={shared_env}" in props
    assert "DynamicUser=yes" in props
    command = words[words.index(props[-1]) + 1 :]
    assert command == [values(svc, "ExecStart")[0].split()[0], "status"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_the_credential_store_recipe_properties_are_valid_unit_settings(tmp_path: Path) -> None:
    """systemd-run's -p takes unit-file assignments (systemd-run(1)): the recipe's, written
    as a service, pass `systemd-analyze verify` without a warning."""
    words = systemd_run_recipe()
    props = [words[i + 1] for i, w in enumerate(words) if w == "-p"]
    relay_bin = Path(sys.executable).parent / "relay"
    unit = tmp_path / "relay-status.service"
    unit.write_text(
        "[Service]\nType=oneshot\n"
        + "".join(p + "\n" for p in props)
        + f"ExecStart={relay_bin} status\n"
    )
    got = subprocess.run(
        ["systemd-analyze", "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert got.returncode == 0 and got.stderr.strip() == "", got.stderr


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

Instruction = tuple[str, str]
# The tools wing's packages (the extras): none may reach the production image.
TOOLS_PACKAGES = ("uvicorn", "rich", "pgserver", "absurdctl", "matplotlib", "pgqueuer")


def dockerfile(text: str | None = None) -> list[Instruction]:
    if text is None:
        text = (DEPLOY / "Dockerfile").read_text()
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stages(lines: list[Instruction]) -> dict[str, tuple[str, list[Instruction]]]:
    """Stage name -> (what it is FROM, its own instructions), in file order."""
    out: dict[str, tuple[str, list[Instruction]]] = {}
    own: list[Instruction] = []
    for word, rest in lines:
        if word == "FROM":
            m = re.fullmatch(r"(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            assert m, rest
            own = []
            out[m.group(2) or str(len(out))] = (m.group(1), own)
        else:
            own.append((word, rest))
    return out


def chain(all_stages: dict[str, tuple[str, list[Instruction]]], name: str) -> list[str]:
    """`name` and the stages it is built FROM, base first."""
    base, _ = all_stages[name]
    return [*(chain(all_stages, base) if base in all_stages else []), name]


def effective(all_stages: dict[str, tuple[str, list[Instruction]]], name: str) -> list[Instruction]:
    """A stage's instructions with those it inherits from the stages it is FROM."""
    return [i for s in chain(all_stages, name) for i in all_stages[s][1]]


def venv_sources(all_stages: dict[str, tuple[str, list[Instruction]]], name: str) -> list[str]:
    """Every stage whose work reaches image `name`: its own chain and, through COPY --from, the
    chains of the stages it copies from."""
    found: list[str] = []
    for s in chain(all_stages, name):
        found.append(s)
        for word, rest in all_stages[s][1]:
            m = re.match(r"--from=(\S+)", rest)
            if word == "COPY" and m:
                found += venv_sources(all_stages, m.group(1))
    return list(dict.fromkeys(found))


def pip_installs(all_stages: dict[str, tuple[str, list[Instruction]]], name: str) -> list[str]:
    """The requirement arguments of every `pip install` whose result reaches image `name`
    (options skipped; anything else, a requirements file too, is a requirement here)."""
    args: list[str] = []
    for s in venv_sources(all_stages, name):
        for word, rest in all_stages[s][1]:
            if word != "RUN":
                continue
            lexer = shlex.shlex(rest, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            words = list(lexer)
            for i in range(len(words) - 1):
                if words[i].endswith("pip") and words[i + 1] == "install":
                    for w in words[i + 2 :]:
                        if w in {"&&", "||", ";", "|", ">", "<", "&"}:
                            break  # the end of this command
                        if not w.startswith("-"):
                            args.append(w)
    return args


def image_problems(lines: list[Instruction], name: str) -> list[str]:
    """What image `name` gets wrong for production: a non-root numeric user, exec-form
    entrypoint (relay is PID 1 and gets SIGTERM), unbuffered logs, no secret in its ENV."""
    final = effective(stages(lines), name)
    problems = []
    user = [rest for word, rest in final if word == "USER"]
    if not (user and re.fullmatch(r"[1-9]\d*(:\d+)?", user[-1])):
        problems.append("a numeric non-root user")
    entry = [rest for word, rest in final if word == "ENTRYPOINT"]
    if not (entry and entry[-1].startswith("[")):
        problems.append("exec-form ENTRYPOINT")
    env = " ".join(rest for word, rest in final if word == "ENV")
    if "PYTHONUNBUFFERED=1" not in env:
        problems.append("PYTHONUNBUFFERED=1")
    if ("STOPSIGNAL", "SIGTERM") not in final:
        problems.append("STOPSIGNAL SIGTERM")
    if re.search(r"RELAY_(DATABASE_URL|INGRESS_TOKEN|SIGNING_SECRET)=", env):
        problems.append("a secret in ENV")
    return problems


def healthcheck_port(final: list[Instruction]) -> int:
    (check,) = [rest for word, rest in final if word == "HEALTHCHECK"][-1:]
    m = re.search(r"http://127\.0\.0\.1:(\d+)/healthz", check)
    assert m, check
    return int(m.group(1))


LOCK = DEPLOY / "requirements.lock"
SINK_LOCK = DEPLOY / "requirements-sink.lock"


def lock_pins(lock: Path = LOCK) -> dict[str, str]:
    """The distributions a lock pins, normalised (PEP 503), with their versions."""
    pins = re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", lock.read_text(), re.M)
    return {re.sub(r"[-_.]+", "-", p).lower(): v for p, v in pins}


def lock_names(lock: Path = LOCK) -> set[str]:
    return set(lock_pins(lock))


def requirement_names(requirements: list[str]) -> set[str]:
    return {
        re.sub(r"[-_.]+", "-", re.split(r"[\[<>=!~;\s]", d, maxsplit=1)[0]).lower()
        for d in requirements
    }


def assert_hashed(lock: Path) -> None:
    """Every pin carries a hash (pip --require-hashes refuses the file otherwise)."""
    blocks = re.split(r"\n(?=[A-Za-z0-9])", lock.read_text().split("\n", 2)[2])
    for block in blocks:
        if "==" in block:
            assert "--hash=sha256:" in block, block.splitlines()[0]


def core_only_problems(text: str | None = None) -> list[str]:
    """The default image (the last stage) must carry the core install only: every pip install
    reaching it is exactly `.`, never an extra or a tools package."""
    all_stages = stages(dockerfile(text))
    default = list(all_stages)[-1]
    args = pip_installs(all_stages, default)
    # The lock of the core dependencies (scripts/lock.sh) is the one other thing it may install.
    problems = [f"installs {a!r}" for a in args if a not in (".", LOCK.name)]
    if LOCK.name in args:
        locked = lock_names()
        problems += [f"the lock pins {p!r}" for p in TOOLS_PACKAGES if p in locked]
    if "." not in args:
        problems.append("never installs the project")
    return problems


def test_dockerfile() -> None:
    lines = dockerfile()
    all_stages = stages(lines)
    assert len(all_stages) >= 2, "multi-stage: build tools stay out of the runtime image"
    default = list(all_stages)[-1]
    assert default == "relay", "the default target is the production relay"
    for image in ("relay", "sink"):
        assert image_problems(lines, image) == [], image
    final = effective(all_stages, default)
    env = " ".join(rest for word, rest in final if word == "ENV")
    port = re.search(r"RELAY_METRICS_ADDR=\S*:(\d+)", env)
    assert port and f"EXPOSE {port.group(1)}" in [f"{w} {r}" for w, r in final]
    assert healthcheck_port(final) == int(port.group(1))
    assert [rest for word, rest in final if word == "CMD"][-1] == '["run"]'


def test_dockerfile_relay_image_installs_the_core_only() -> None:
    assert core_only_problems() == []
    assert "build-sink" not in venv_sources(stages(dockerfile()), "relay")
    # The build itself refuses a tools package that leaked into the core venv.
    build = " ".join(rest for word, rest in stages(dockerfile())["build"][1] if word == "RUN")
    assert all(f"'{package}'" in build for package in TOOLS_PACKAGES), build


@pytest.mark.parametrize(
    "mutant",
    [
        "/opt/ledger-relay/bin/pip install --no-deps .",  # the original: no problem
        "/opt/ledger-relay/bin/pip install --no-deps '.[sink]'",
        "/opt/ledger-relay/bin/pip install --no-deps . rich",
        "/opt/ledger-relay/bin/pip install --no-deps -r requirements.txt",
    ],
)
def test_core_only_check_catches_an_extra_in_the_relay_image(mutant: str) -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    original = "/opt/ledger-relay/bin/pip install --no-deps . "
    assert text.count(original) == 1
    problems = core_only_problems(text.replace(original, mutant + " "))
    assert bool(problems) == (mutant != original.strip()), problems
    # An extra installed in a stage the relay image copies from is caught too.
    mutated = text.replace("COPY --from=build /opt", "COPY --from=build-sink /opt")
    assert core_only_problems(mutated) == [
        "installs 'requirements-sink.lock'",
        "installs '.[sink]'",
    ]


def test_dockerfile_installs_the_lock_with_hashes_and_compiles_bytecode() -> None:
    """Issue 15 item 5: locked dependencies, verified by hash, then the project alone; .pyc
    compiled at build (no --no-compile); the base image one build argument to pin by digest."""
    build = " ".join(rest for word, rest in stages(dockerfile())["build"][1] if word == "RUN")
    lock_at = build.index(f"--require-hashes -r {LOCK.name}")
    assert build.index("install --no-deps .") > lock_at
    assert "--no-compile" not in (DEPLOY / "Dockerfile").read_text()
    copies = [rest for word, rest in stages(dockerfile())["build"][1] if word == "COPY"]
    assert f"deploy/{LOCK.name} ./" in copies
    froms = [rest.split()[0] for word, rest in dockerfile() if word == "FROM"]
    assert all(f in ("${PYTHON_IMAGE}", "build", "runtime") for f in froms), froms
    assert ("ARG", "PYTHON_IMAGE=python:3.11-slim-bookworm") in dockerfile()


def test_the_lock_pins_every_core_dependency_with_hashes() -> None:
    import tomllib

    project = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]
    core = requirement_names(project["dependencies"])
    locked = lock_names()
    assert core <= locked, core - locked
    assert not locked & set(TOOLS_PACKAGES)
    assert_hashed(LOCK)


def test_the_sink_image_is_locked_alike() -> None:
    """Issue 15 leftover: the sink lock pins the core and the `sink` extra, with hashes, at the
    core lock's versions; the sink stage installs it with --require-hashes, then the project
    alone."""
    import tomllib

    project = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]
    sink = requirement_names(project["optional-dependencies"]["sink"])
    core, pins = lock_pins(LOCK), lock_pins(SINK_LOCK)
    assert sink <= set(pins), sink - set(pins)
    assert {name: pins.get(name) for name in core} == core  # the same versions as the relay's
    assert_hashed(SINK_LOCK)
    stage = stages(dockerfile())["build-sink"][1]
    build = " ".join(rest for word, rest in stage if word == "RUN")
    lock_at = build.index(f"--require-hashes -r {SINK_LOCK.name}")
    assert build.index("install --no-deps '.[sink]'") > lock_at
    assert f"deploy/{SINK_LOCK.name} ./" in [rest for word, rest in stage if word == "COPY"]


def sink_port(command: list[str]) -> int:
    return int(command[command.index("--port") + 1])


def test_dockerfile_sink_target() -> None:
    all_stages = stages(dockerfile())
    assert "sink" in all_stages, "a `sink` target for the reference ingress"
    assert pip_installs(all_stages, "sink") == [LOCK.name, ".", SINK_LOCK.name, ".[sink]"]
    final = effective(all_stages, "sink")
    cmd = json.loads([rest for word, rest in final if word == "CMD"][-1])
    assert cmd[0] == "sink"
    assert f"EXPOSE {sink_port(cmd)}" in [f"{w} {r}" for w, r in final]
    assert healthcheck_port(final) == sink_port(cmd)
    assert not any(word == "ENV" and "RELAY_METRICS_ADDR" in rest for word, rest in final)


def test_compose() -> None:
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = doc["services"]
    assert {"postgres", "relay", "sink", "migrate"} <= set(services)
    relay = services["relay"]
    assert relay["deploy"]["replicas"] == 3
    env = relay["environment"]
    assert "RELAY_DATABASE_URL" not in env and "RELAY_DATABASE_URL_FILE" in env
    drain = parse_duration(env["RELAY_SHUTDOWN_TIMEOUT"])
    assert parse_duration(relay["stop_grace_period"]) > stop_budget(drain)
    assert relay["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert relay["ulimits"]["nofile"]["soft"] >= 16 * MAX_CONNECTIONS
    assert services["migrate"]["command"] == ["migrate"]
    assert services["sink"]["command"][0] == "sink"
    assert "sink:" in env["RELAY_INGRESS_URL"] and "{run_id}" in env["RELAY_INGRESS_URL"]
    for secret in doc["secrets"].values():
        example = DEPLOY / (secret["file"] + ".example")
        assert example.exists(), example


def test_compose_sink_runs_the_sink_image() -> None:
    """The sink service builds the Dockerfile's `sink` target under its own tag (the relay's
    image has no uvicorn); its probe and ports are the sink's, not the relay's :9100."""
    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    all_stages = stages(dockerfile())
    sink, relay = services["sink"], services["relay"]
    assert sink["build"]["target"] == "sink" and "sink" in all_stages
    for name in ("relay", "migrate"):
        assert services[name]["build"].get("target", list(all_stages)[-1]) == "relay", name
    assert sink["image"] != relay["image"]
    port = sink_port(sink["command"])
    assert [str(p).rpartition(":")[2] for p in sink["ports"]] == [str(port)]
    probe = " ".join(sink["healthcheck"]["test"])
    assert f"127.0.0.1:{port}/healthz" in probe and ":9100" not in probe
    assert not any("RELAY_METRICS_ADDR" in str(e) for e in sink.get("environment", {}))
    assert f"//sink:{port}/" in relay["environment"]["RELAY_INGRESS_URL"]
    assert relay["depends_on"]["sink"]["condition"] == "service_healthy"


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
    assert pod["terminationGracePeriodSeconds"] > stop_budget(drain)
    # Probes on the relay's own endpoints, on the port metrics_addr listens on.
    assert relay["livenessProbe"]["httpGet"]["path"] == "/healthz"
    ports = {p["name"]: p["containerPort"] for p in relay["ports"]}
    metrics_port = int(env["RELAY_METRICS_ADDR"]["value"].rpartition(":")[2])
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert ports[relay[probe]["httpGet"]["port"]] == metrics_port
    # Secrets come from the Secret, as files; no secret value in the manifest's env.
    for name, e in env.items():
        assert name.removeprefix("RELAY_").lower() not in SECRET_OPTIONS, name
        assert "postgresql://" not in str(e.get("value", ""))
    (example,) = load_all(DEPLOY / "k8s-examples" / "secret.example.yaml")
    names = {source["name"] for v in pod["volumes"] for source, _ in secret_sources(v)}
    assert names == {example["metadata"]["name"]}
    assert env["RELAY_DATABASE_URL_FILE"]["value"].startswith(relay["volumeMounts"][0]["mountPath"])
    labels = spec["template"]["metadata"]["labels"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert relay["securityContext"]["allowPrivilegeEscalation"] is False
    # Upgrades: the schema is migrated before a new pod's relay starts; the init container
    # is bounded like the relay.
    assert pod["initContainers"][0]["args"] == ["migrate"]
    for container in [*pod["initContainers"], *pod["containers"]]:
        assert container["resources"]["requests"], container["name"]
        assert container["resources"]["limits"]["memory"], container["name"]
    # Replicas spread over nodes (and zones), selecting these pods.
    spread = pod["topologySpreadConstraints"]
    assert "kubernetes.io/hostname" in {c["topologyKey"] for c in spread}
    for c in spread:
        assert c["labelSelector"]["matchLabels"].items() <= labels.items()
    # The disruption budget covers these pods.
    pdb = objs["PodDisruptionBudget"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert spec["selector"]["matchLabels"].items() <= labels.items()


def test_kubectl_apply_of_the_k8s_directory_applies_no_secret() -> None:
    """`kubectl apply -f deploy/k8s/` must not create a Secret with change-me values or the
    public sample whsec_ key: the example lives in deploy/k8s-examples/."""
    assert "Secret" not in k8s_objects()
    for path in (DEPLOY / "k8s").iterdir():
        assert "change-me" not in path.read_text() and "whsec_" not in path.read_text(), path


def test_image_user_matches_kubernetes_user() -> None:
    user = [rest for word, rest in dockerfile() if word == "USER"][-1]
    pod = k8s_objects()["Deployment"]["spec"]["template"]["spec"]
    assert int(user.split(":")[0]) == pod["securityContext"]["runAsUser"]


# What the kubelet does with a secret volume (pkg/volume/secret, volume.SetVolumeOwnership):
# the files are owned by root; with a pod `fsGroup` their group becomes fsGroup and, the volume
# being read-only, 0440 is added to their mode. Without `defaultMode` the mode is 0644.
SECRET_DEFAULT_MODE = 0o644
FS_GROUP_READ_ONLY_MASK = 0o440


FileAccess = tuple[int, int, int]  # owner uid, group gid, mode


class MountFailure(Exception):
    """The kubelet cannot set the volume up: the pod stays in ContainerCreating."""


def secret_sources(volume: dict[str, Any]) -> list[tuple[dict[str, Any], int]]:
    """The Secrets a `secret` or `projected` volume takes its files from, each as (source, the
    mode its files get unless an item says otherwise), the source as a projected one's:
    `name`, `items`, `optional`."""
    if "secret" in volume:
        secret = volume["secret"]
        source = {**secret, "name": secret["secretName"]}
        return [(source, secret.get("defaultMode", SECRET_DEFAULT_MODE))]
    if "projected" in volume:
        mode = volume["projected"].get("defaultMode", SECRET_DEFAULT_MODE)
        return [(s["secret"], mode) for s in volume["projected"]["sources"] if "secret" in s]
    return []


def volume_files(volume: dict[str, Any], secrets: dict[str, set[str]]) -> dict[str, int]:
    """The files (path -> mode) the kubelet puts in a secret or projected volume, given the
    keys each Secret holds (pkg/volume/secret MakePayload, pkg/volume/projected collectData):
    without `items` every key of the Secret; with them each item, and an item whose key the
    Secret lacks fails the mount unless the source is `optional: true`, when it is left out
    (as is the whole source of an optional Secret that does not exist)."""
    files: dict[str, int] = {}
    for source, default_mode in secret_sources(volume):
        optional = source.get("optional", False)
        keys = secrets.get(source["name"])
        if keys is None:
            if optional:
                continue
            raise MountFailure(f'secret "{source["name"]}" not found')
        items = source.get("items") or [{"key": k, "path": k} for k in sorted(keys)]
        for item in items:
            if item["key"] not in keys:
                if optional:
                    continue
                raise MountFailure(f"references non-existent secret key: {item['key']}")
            files[item["path"]] = item.get("mode", default_mode)
    return files


def secret_files(
    volume: dict[str, Any], keys: set[str], fs_group: int | None
) -> dict[str, FileAccess]:
    """The files of a secret or projected volume as the kubelet makes them, its Secret holding
    `keys`: path -> (owner, group, mode)."""
    files = volume_files(volume, {source["name"]: keys for source, _ in secret_sources(volume)})
    if fs_group is None:
        return {path: (0, 0, mode) for path, mode in files.items()}
    return {path: (0, fs_group, mode | FS_GROUP_READ_ONLY_MASK) for path, mode in files.items()}


def can_read(uid: int, gids: set[int], file: FileAccess) -> bool:
    """POSIX permission check: the first class that matches (owner, group, other) decides."""
    owner, group, mode = file
    if uid == 0:
        return True
    if uid == owner:
        return bool(mode & 0o400)
    if group in gids:
        return bool(mode & 0o040)
    return bool(mode & 0o004)


def unreadable_secrets(pod: dict[str, Any], keys: set[str]) -> list[str]:
    """Every (container, secret file) whose process cannot read the file, the Secret holding
    `keys`: computed from the pod's and the container's runAsUser/runAsGroup, fsGroup,
    supplementalGroups and the volume's modes."""
    pod_ctx = pod.get("securityContext", {})
    fs_group = pod_ctx.get("fsGroup")
    volumes = {v["name"]: v for v in pod["volumes"] if secret_sources(v)}
    problems = []
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        ctx = {**pod_ctx, **container.get("securityContext", {})}
        uid = ctx["runAsUser"]
        gids = {ctx.get("runAsGroup", 0), *pod_ctx.get("supplementalGroups", [])}
        if fs_group is not None:
            gids.add(fs_group)
        for mount in container.get("volumeMounts", []):
            volume = volumes.get(mount["name"])
            if volume is None:
                continue
            for path, file in sorted(secret_files(volume, keys, fs_group).items()):
                if not can_read(uid, gids, file):
                    problems.append(f"{container['name']}: {mount['mountPath']}/{path}")
    return problems


def test_the_pods_user_can_read_every_mounted_secret() -> None:
    """uid 10001 once got root-owned 0400 files and no fsGroup: it could read none of its
    secrets (issue 41). Every key of the Secret's shape, in every container that mounts it."""
    pod = k8s_objects()["Deployment"]["spec"]["template"]["spec"]
    (example,) = load_all(DEPLOY / "k8s-examples" / "secret.example.yaml")
    keys = set(example["stringData"])
    assert {"database_url", "ingress_token", "signing_secret"} <= keys
    assert pod["securityContext"]["runAsUser"] != 0
    assert unreadable_secrets(pod, keys) == []
    # Only the pod's own group reads them, not every user of the node.
    fs_group = pod["securityContext"].get("fsGroup")
    (volume,) = [v for v in pod["volumes"] if secret_sources(v)]
    files = secret_files(volume, keys, fs_group)
    assert set(files) == keys
    for path, (_, _, mode) in files.items():
        assert not mode & 0o007, path
    # The check sees the shipped mistake: 0400 without fsGroup.
    planted = yaml.safe_load(yaml.safe_dump(pod))
    del planted["securityContext"]["fsGroup"]
    for v in planted["volumes"]:
        for kind in ("secret", "projected"):
            if kind in v:
                v[kind]["defaultMode"] = 0o400
    assert len(unreadable_secrets(planted, keys)) == len(keys) * 2  # the migration and the relay


# Every secret the relay reads, with a value its settings accept.
SECRET_VALUES = {
    "database_url": "postgresql://relay:pw@pgbouncer:6432/relay",
    "listen_database_url": "postgresql://relay:pw@pg-direct:5432/relay",
    "ingress_token": "ingress-token-value",
    "signing_secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
    "ui_token": "0123456789abcdef0123",
    "ingress_proxy": "http://proxy.internal:3128",
}


def start_pod(pod: dict[str, Any], secret: dict[str, str], root: Path) -> dict[str, dict[str, str]]:
    """What the kubelet makes of `pod` with the Secret `ledger-relay` holding `secret`: its
    secret volumes written under `root` (MountFailure when one cannot be set up), and each
    container's environment, its paths moved under `root` alike (a fieldRef reads the pod's
    name). Container name -> environment."""
    mounts: dict[str, Path] = {}
    volumes = {v["name"]: v for v in pod["volumes"] if secret_sources(v)}
    for name, volume in volumes.items():
        files = volume_files(volume, {"ledger-relay": set(secret)})
        (root / name).mkdir(parents=True)
        for path in files:
            key = next(
                item["key"]
                for source, _ in secret_sources(volume)
                for item in source.get("items") or [{"key": path, "path": path}]
                if item["path"] == path
            )
            (root / name / path).write_text(secret[key] + "\n")
        mounts[name] = root / name
    out = {}
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        moved = {m["mountPath"]: mounts[m["name"]] for m in container.get("volumeMounts", [])}
        env = {"PATH": "/usr/bin:/bin", "HOME": str(root)}
        for e in container.get("env", []):
            value = e.get("value", "ledger-relay-5d4f7-abcde")
            for mount_path, real in moved.items():
                if value == mount_path or value.startswith(mount_path + "/"):
                    value = str(real) + value[len(mount_path) :]
            env[e["name"]] = value
        out[container["name"]] = env
    return out


def relay_settings(env: dict[str, str]) -> dict[str, str | None]:
    """The secrets `relay run` reads from `env` (relay/settings.py load, as at start), each as
    its text or None when unset."""
    from relay.settings import load

    settings = load({}, env)
    return {name: secret_text(getattr(settings, name)) for name in sorted(SECRET_OPTIONS)}


def secret_text(value: Any) -> str | None:
    if not value:  # None, or signing_secret's empty tuple of keys
        return None
    if isinstance(value, tuple):
        return " ".join(v.reveal() for v in value)
    return str(value.reveal())


def migrate_database_url(env: dict[str, str]) -> str | None:
    """The URL `relay migrate` reads from `env` (relay/cli.py _database_url)."""
    from relay.settings import option_value

    url = option_value("database_url", {}, env)
    return None if url is None else str(url.reveal())


def test_kubernetes_secret_keys_other_than_database_url_are_optional(tmp_path: Path) -> None:
    """Issue 49 item 8: a Secret of database_url alone (what systemd needs) starts the pods; a
    Secret with every key gives the relay every one of them, ui_token included (without it the
    status page answers 403); a Secret without database_url keeps the pod from starting,
    naming the key. The relay's environment read by the relay's own settings code."""
    pod = k8s_objects()["Deployment"]["spec"]["template"]["spec"]
    only_url = {"database_url": SECRET_VALUES["database_url"]}
    envs = start_pod(pod, only_url, tmp_path / "minimal")
    got = relay_settings(envs["relay"])
    assert got == {name: only_url.get(name) for name in SECRET_OPTIONS}
    assert migrate_database_url(envs["migrate"]) == only_url["database_url"]

    envs = start_pod(pod, SECRET_VALUES, tmp_path / "every")
    assert relay_settings(envs["relay"]) == SECRET_VALUES
    assert migrate_database_url(envs["migrate"]) == SECRET_VALUES["database_url"]

    without_url = {k: v for k, v in SECRET_VALUES.items() if k != "database_url"}
    with pytest.raises(MountFailure, match="database_url"):
        start_pod(pod, without_url, tmp_path / "no-url")

    # The check sees the shipped mistake: a RELAY_<NAME>_FILE for an optional key.
    from relay.settings import ConfigError

    planted = yaml.safe_load(yaml.safe_dump(pod))
    (relay,) = [c for c in planted["containers"] if c["name"] == "relay"]
    mount = relay["volumeMounts"][0]["mountPath"]
    relay["env"].append({"name": "RELAY_SIGNING_SECRET_FILE", "value": f"{mount}/signing_secret"})
    envs = start_pod(planted, only_url, tmp_path / "planted")
    with pytest.raises(ConfigError, match="RELAY_SIGNING_SECRET_FILE"):
        relay_settings(envs["relay"])


def test_kubernetes_secret_example_names_only_keys_the_pods_read() -> None:
    """Every key of the example Secret is one the volume projects (a key it does not would be
    silently ignored), and ui_token is among them."""
    pod = k8s_objects()["Deployment"]["spec"]["template"]["spec"]
    (example,) = load_all(DEPLOY / "k8s-examples" / "secret.example.yaml")
    (volume,) = [v for v in pod["volumes"] if secret_sources(v)]
    projected = {item["key"] for source, _ in secret_sources(volume) for item in source["items"]}
    assert set(example["stringData"]) <= projected == set(SECRET_OPTIONS)
    assert "ui_token" in example["stringData"]


def test_kubernetes_probes_ask_only_what_the_replica_itself_can_fix() -> None:
    """Issue 49 item 8: the database, LISTEN, the schema and the ingress are shared by every
    replica, so a probe that asks about them fails on every pod at once (`/readyz` did: the
    Deployment unavailable, the disruption budget at zero, node drains blocked while the fleet
    was hurt). Every probe asks `/healthz` (the loops turn), which answers 200 while the
    database is out; `/readyz` answers 503 then (relay/serving/health.py)."""
    from relay.serving.health import readiness, waiting_route

    pod = k8s_objects()["Deployment"]["spec"]["template"]["spec"]
    (relay,) = [c for c in pod["containers"] if c["name"] == "relay"]
    probes = {
        p: relay[p]["httpGet"]["path"] for p in ("livenessProbe", "readinessProbe", "startupProbe")
    }
    # While the database is out (the relay waiting for it at start), every probe passes...
    for probe, path in probes.items():
        assert waiting_route("GET", path, "")[0] == 200, (probe, path)
    # ...which /readyz does not, at start or running.
    assert waiting_route("GET", "/readyz", "")[0] == 503
    down = {"started": True, "schema_problem": None, "listen_up": True, "ingress_ok": True}
    assert readiness(database=False, **down)[0] is False
    ops = (DEPLOY.parent / "docs" / "operations.md").read_text()
    assert "What each probe means" in ops


def test_the_disruption_budget_never_waits_for_an_unhealthy_pod() -> None:
    """Issue 49 item 8: a pod that is not Ready may always be evicted, so a drain never blocks
    on a pod that cannot turn Ready (the default, IfHealthyBudget, counts it against the
    budget)."""
    pdb = k8s_objects()["PodDisruptionBudget"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert pdb["spec"]["maxUnavailable"] == 1


def test_kubernetes_image_is_one_you_build_and_name() -> None:
    """No public image is published: the manifests name a placeholder registry (example.com,
    which resolves to nothing, so nothing else is pulled by mistake), one image for the
    migration and the relay, and docs/operations.md says how to build, push and name it."""
    pod = k8s_objects()["Deployment"]["spec"]["template"]["spec"]
    images = {c["image"] for c in [*pod["initContainers"], *pod["containers"]]}
    (image,) = images
    repository, _, tag = image.rpartition(":")
    assert repository == "registry.example.com/ledger-relay" and tag
    ops = (DEPLOY.parent / "docs" / "operations.md").read_text()
    built = repository.replace("registry.example.com", "$REGISTRY")
    assert f"docker build -f deploy/Dockerfile -t {built}" in ops
    assert "docker push" in ops and "registry.example.com" in ops
