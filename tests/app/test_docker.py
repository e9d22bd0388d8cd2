"""Checks of the container files in docker/ (no Docker engine needed).

The compose file is validated with the `docker-compose` command when it is
installed (Debian's docker-compose 1.29: `apt-get install docker-compose`);
those tests are skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"  # docker/Dockerfile.dockerignore links to it
COMPOSE = DOCKER / "compose.yaml"
FLEET = DOCKER / "compose.fleet.yaml"
FLEET_TOML = DOCKER / "tierd.fleet.toml"
CUFILE = DOCKER / "cufile.json"
TIERD_TOML = DOCKER / "tierd.toml"

CONFIG_PATH = "/etc/tierd/tierd.toml"
PORT = 8470
DOCKER_COMPOSE = shutil.which("docker-compose")
needs_compose = pytest.mark.skipif(DOCKER_COMPOSE is None, reason="docker-compose is not installed")


# --------------------------------------------------------------------------- helpers


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, "Dockerfile ends inside a line continuation"
    return out


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    starts = [i for i, (word, _) in enumerate(instructions) if word == "FROM"]
    assert starts, "Dockerfile has no FROM"
    return instructions[starts[-1] :]


def arg_defaults(instructions: list[tuple[str, str]]) -> dict[str, str]:
    defaults: dict[str, str] = {}
    for word, rest in instructions:
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            defaults[name.strip()] = value.strip().strip('"')
    return defaults


def expand(value: str, variables: dict[str, str]) -> str:
    return re.sub(
        r"\$\{(\w+)\}|\$(\w+)",
        lambda m: variables.get(m.group(1) or m.group(2), m.group(0)),
        value,
    )


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether a context path is excluded by .dockerignore patterns (last match wins)."""

    def to_regex(pattern: str) -> re.Pattern[str]:
        rx = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                rx += "(?:.*/)?"
                i += 3
            elif pattern.startswith("**", i):
                rx += ".*"
                i += 2
            elif pattern[i] == "*":
                rx += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                rx += "[^/]"
                i += 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                rx += pattern[i : end + 1]
                i = end + 1
            else:
                rx += re.escape(pattern[i])
                i += 1
        return re.compile(rx + r"(?:/.*)?\Z")  # a matched directory excludes its contents

    result = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        if to_regex(pattern.strip("/")).match(path):
            result = not negate
    return result


def dockerignore_patterns() -> list[str]:
    return [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def compose_config(
    env_overrides: dict[str, str], tmp_path: Path, compose: Path = COMPOSE
) -> subprocess.CompletedProcess[str]:
    """Run `docker-compose config` with a controlled environment and an empty env file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIERD_", "COMPOSE_", "AWS_"))}
    env.update(env_overrides)
    empty_env_file = tmp_path / "empty.env"
    empty_env_file.write_text("")
    assert DOCKER_COMPOSE is not None
    return subprocess.run(
        [DOCKER_COMPOSE, "--env-file", str(empty_env_file), "-f", str(compose), "config"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


TOKENS = {"TIERD_ADMIN_TOKEN": "admin-secret", "TIERD_DATA_TOKEN": "data-secret"}


# --------------------------------------------------------------------------- cufile.json


def test_cufile_json_is_valid_and_allows_compat_mode() -> None:
    config = json.loads(CUFILE.read_text())
    props = config["properties"]
    assert props["allow_compat_mode"] is True
    for section in ("logging", "profile", "execution", "properties", "fs"):
        assert section in config, section
    # Alignment rules from NVIDIA's shipped cufile.json comments.
    assert props["max_direct_io_size_kb"] % 64 == 0
    assert props["per_buffer_cache_size_kb"] % 64 == 0
    assert props["max_device_cache_size_kb"] % 4 == 0
    assert props["max_device_pinned_mem_size_kb"] % 4 == 0
    assert props["max_device_cache_size_kb"] // props["per_buffer_cache_size_kb"] >= props.get(
        "io_batchsize", 128
    )
    assert len(props["posix_pool_slab_size_kb"]) == len(props["posix_pool_slab_count"])


# --------------------------------------------------------------------------- tierd.toml


def test_tierd_toml_names_the_three_tiers() -> None:
    config = tomllib.loads(TIERD_TOML.read_text())
    assert [(t["name"], t["path"]) for t in config["tiers"]] == [
        ("nvme", "/nvme"),
        ("ssd", "/ssd"),
        ("hdd", "/hdd"),
    ]
    assert config["host"] == "0.0.0.0"
    assert config["port"] == PORT
    assert config["catalog_url"] == "sqlite:////var/lib/tierd/catalog.db"
    # Tokens come from the environment, never from a file baked into the image.
    text = TIERD_TOML.read_text().lower()
    assert not any(key for key in config if "token" in key.lower())
    assert "admin_token =" not in text and "data_token =" not in text


def test_tierd_toml_is_accepted_by_the_settings_model(monkeypatch: pytest.MonkeyPatch) -> None:
    settings_mod = pytest.importorskip("app.settings")
    for key in list(os.environ):
        if key.startswith("TIERD_"):
            monkeypatch.delenv(key)
    settings = settings_mod.get_settings(
        config_file=TIERD_TOML, admin_token="admin-secret", data_token="data-secret"
    )
    assert [(t.name, str(t.path)) for t in settings.tiers] == [
        ("nvme", "/nvme"),
        ("ssd", "/ssd"),
        ("hdd", "/hdd"),
    ]
    assert (settings.host, settings.port) == ("0.0.0.0", PORT)
    assert not settings.is_loopback() and settings.auth_enabled


# --------------------------------------------------------------------------- Dockerfile


def test_dockerfile_runs_as_non_root_with_healthcheck() -> None:
    stage = final_stage()
    variables = arg_defaults(dockerfile_instructions())
    words = [word for word, _ in stage]

    from_image = expand(stage[0][1].split()[0], variables)
    assert re.match(r"(nvcr\.io/)?nvidia/cuda:13\.\d+\.\d+-runtime-ubuntu24\.04$", from_image)

    users = [expand(rest, variables) for word, rest in stage if word == "USER"]
    assert users, "final stage has no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0", ""), users[-1]

    assert "HEALTHCHECK" in words
    healthcheck = next(rest for word, rest in stage if word == "HEALTHCHECK")
    assert "CMD" in healthcheck and "/healthz" in healthcheck and "127.0.0.1" in healthcheck
    assert "curl" not in healthcheck and "python" in healthcheck

    expose = [rest for word, rest in stage if word == "EXPOSE"]
    assert any(str(PORT) in rest.split() for rest in expose)

    entrypoint = [json.loads(rest) for word, rest in stage if word == "ENTRYPOINT"]
    assert entrypoint[-1] == ["tierd"]
    cmd = [json.loads(rest) for word, rest in stage if word == "CMD"]
    assert cmd[-1] == ["serve", "--config", CONFIG_PATH]


def test_dockerfile_installs_the_extras_its_argument_names_non_editable() -> None:
    instructions = dockerfile_instructions()
    runs = [rest for word, rest in instructions if word == "RUN"]
    installs = [
        arg
        for rest in runs
        for part in rest.split("&&")
        if "pip install" in part
        for arg in shlex.split(part)
    ]
    assert "/src[${EXTRAS}]" in installs, installs
    assert "-e" not in installs and "--editable" not in installs
    # The GPU extras by default; CPU hosts build with EXTRAS=server.
    args = [rest for word, rest in instructions if word == "ARG"]
    assert "EXTRAS=server,gpu,gpu-codec" in args and any(a.startswith("BASE_IMAGE=") for a in args)
    # The wheel is checked from outside the source tree (WORKDIR /src would import that).
    check = next(r for r in runs if "_migrations" in r)
    assert "cd /" in check and check.index("cd /") < check.index("python -c")


def test_dockerfile_copies_only_what_the_dockerignore_lets_through() -> None:
    patterns = dockerignore_patterns()
    for unwanted in (".venv", ".git", "tierd-data", ".whl", "x.whl", "app/__pycache__/m.pyc"):
        assert ignored(unwanted, patterns), unwanted
    sources = []
    for word, rest in dockerfile_instructions():
        if word == "COPY" and "--from=" not in rest:
            *srcs, _dest = rest.split()
            sources += srcs
    assert {"pyproject.toml", "README.md", "app", "tiering", "migrations"} <= set(sources)
    for src in sources:
        assert not ignored(src, patterns), f"{src} is copied but excluded from the context"
        if src != "README.md":  # README.md may not be written yet in a fresh checkout
            assert (ROOT / src).exists(), src


# --------------------------------------------------------------------------- compose.yaml


@needs_compose
def test_compose_validates_and_renders_gpu_host_settings(tmp_path: Path) -> None:
    proc = compose_config(TOKENS, tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout

    # Text checks work with or without PyYAML.
    assert re.search(r"driver: nvidia", out)
    assert re.search(r"capabilities:\s*\n\s*- gpu", out)
    assert re.search(r"count: all", out)
    assert re.search(r"memlock:\s*\n\s*hard: -1\s*\n\s*soft: -1", out)
    assert "/run/udev:/run/udev:ro" in out
    assert "127.0.0.1:8470:8470" in out
    assert re.search(r"docker/cufile\.json:/etc/cufile\.json:ro", out)
    assert re.search(r"docker/tierd\.toml:" + re.escape(CONFIG_PATH) + ":ro", out)
    assert "CUFILE_ENV_PATH_JSON: /etc/cufile.json" in out
    assert "TIERD_ADMIN_TOKEN: admin-secret" in out
    assert "TIERD_DATA_TOKEN: data-secret" in out
    assert "catalog:/var/lib/tierd" in out
    assert "ipc: shareable" in out
    assert "restart: unless-stopped" in out
    assert "stop_grace_period: 30s" in out
    for tier in tomllib.loads(TIERD_TOML.read_text())["tiers"]:
        assert f":{tier['path']}:rw" in out, tier

    try:
        import yaml
    except ImportError:
        return
    service = yaml.safe_load(out)["services"]["tierd"]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]} in devices
    assert service["ulimits"]["memlock"] == {"soft": -1, "hard": -1}
    assert service["build"]["dockerfile"] == "docker/Dockerfile"
    assert Path(service["build"]["context"]) == ROOT


@needs_compose
def test_compose_publish_and_gpu_count_are_configurable(tmp_path: Path) -> None:
    proc = compose_config(
        {**TOKENS, "TIERD_PUBLISH": "0.0.0.0:9000", "TIERD_GPUS": "2", "TIERD_NVME": "/mnt/fast"},
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "0.0.0.0:9000:8470" in proc.stdout
    assert re.search(r"count: '?2'?", proc.stdout)
    assert "/mnt/fast:/nvme:rw" in proc.stdout


@needs_compose
@pytest.mark.parametrize("missing", sorted(TOKENS))
def test_compose_refuses_to_render_without_tokens(tmp_path: Path, missing: str) -> None:
    env = {k: v for k, v in TOKENS.items() if k != missing}
    proc = compose_config(env, tmp_path)
    assert proc.returncode != 0
    assert f"set {missing}" in proc.stderr


# --------------------------------------------------------------------------- compose.fleet.yaml

FLEET_ENV = {
    **TOKENS,
    "TIERD_PG_PASSWORD": "pgsecret",
    "TIERD_S3_URL": "s3://my-models/prod",
}
FLEET_HOSTS = ("tierd-a", "tierd-b")


def fleet_services(tmp_path: Path, env: dict[str, str]) -> dict[str, Any]:
    yaml = pytest.importorskip("yaml")
    proc = compose_config(env, tmp_path, FLEET)
    assert proc.returncode == 0, proc.stderr
    services: dict[str, Any] = yaml.safe_load(proc.stdout)["services"]
    return services


def fleet_settings(service: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The settings a fleet host builds from its rendered environment and tierd.fleet.toml."""
    settings_mod = pytest.importorskip("app.settings")
    for key in list(os.environ):
        if key.startswith("TIERD_"):
            monkeypatch.delenv(key)
    names = set(settings_mod.Settings.model_fields)
    for key, value in service["environment"].items():
        if key.startswith("TIERD_") and value is not None:
            # pydantic-settings ignores a TIERD_* variable it has no field for: catch typos here.
            assert key.removeprefix("TIERD_").lower() in names, key
            monkeypatch.setenv(key, str(value))
    return settings_mod.get_settings(config_file=FLEET_TOML)


@needs_compose
def test_fleet_compose_renders_postgres_and_two_gpu_hosts(tmp_path: Path) -> None:
    services = fleet_services(tmp_path, FLEET_ENV)
    assert set(services) == {"postgres", *FLEET_HOSTS}  # MinIO stays a commented example
    pg = services["postgres"]
    assert re.fullmatch(r"postgres:15(\.\d+)?", pg["image"])
    assert "pg_isready" in " ".join(pg["healthcheck"]["test"])
    assert pg["environment"]["POSTGRES_PASSWORD"] == "pgsecret"
    assert "pgdata:/var/lib/postgresql/data:rw" in pg["volumes"]
    assert "ports" not in pg  # reached on the compose network only
    ports: set[str] = set()
    volumes: set[str] = set()
    for name in FLEET_HOSTS:
        service = services[name]
        assert service["depends_on"] == {"postgres": {"condition": "service_healthy"}}
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]} in devices
        assert service["ulimits"]["memlock"] == {"soft": -1, "hard": -1}
        assert service["build"]["dockerfile"] == "docker/Dockerfile"
        assert service["ipc"] == "shareable" and service["stop_grace_period"] == "30s"
        env = service["environment"]
        assert env["TIERD_HOST_ID"] == name and env["TIERD_ADVERTISE_URL"] == f"http://{name}:8470"
        assert env["TIERD_CATALOG_URL"] == "postgresql+psycopg://tierd:pgsecret@postgres:5432/tierd"
        # Credentials pass through from the shell only when set there: never an empty key.
        assert env["AWS_ACCESS_KEY_ID"] is None and env["AWS_REGION"] is None
        assert any(v.endswith(f":{CONFIG_PATH}:ro") and "tierd.fleet.toml" in v
                   for v in service["volumes"])  # fmt: skip
        ports.update(service["ports"])
        volumes.update(v.split(":")[0] for v in service["volumes"] if ":/nvme" in v)
    assert ports == {"127.0.0.1:8470:8470/tcp", "127.0.0.1:8471:8470/tcp"}
    assert volumes == {"nvme-a", "nvme-b"}  # each host's directory tier is its own


@needs_compose
def test_fleet_hosts_settings_are_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {**FLEET_ENV, "TIERD_S3_ENDPOINT": "http://minio:9000"}
    services = fleet_services(tmp_path, env)
    for name in FLEET_HOSTS:
        settings = fleet_settings(services[name], monkeypatch)
        assert settings.host_id == name and settings.advertise_url == f"http://{name}:8470"
        assert settings.catalog_url.startswith("postgresql+psycopg://tierd:pgsecret@postgres")
        assert [
            (t.name, t.kind or ("object" if t.url else "directory")) for t in settings.tiers
        ] == [
            ("nvme", "directory"),
            ("s3", "object"),
        ]
        assert str(settings.tiers[0].path) == "/nvme"
        assert settings.tiers[1].url == "s3://my-models/prod"
        assert settings.tiers[1].endpoint_url == "http://minio:9000"
        assert (settings.host, settings.port) == ("0.0.0.0", PORT)
        assert not settings.is_loopback() and settings.auth_enabled


@needs_compose
def test_fleet_aws_s3_needs_no_endpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No TIERD_S3_ENDPOINT: the endpoint renders empty, which tierd reads as AWS S3 itself.
    services = fleet_services(tmp_path, {**FLEET_ENV, "AWS_REGION": "eu-west-1"})
    assert services["tierd-a"]["environment"]["AWS_REGION"] == "eu-west-1"
    settings = fleet_settings(services["tierd-a"], monkeypatch)
    assert not settings.tiers[1].endpoint_url


@needs_compose
@pytest.mark.parametrize("missing", sorted(FLEET_ENV))
def test_fleet_compose_refuses_to_render_without(tmp_path: Path, missing: str) -> None:
    env = {k: v for k, v in FLEET_ENV.items() if k != missing}
    proc = compose_config(env, tmp_path, FLEET)
    assert proc.returncode != 0
    assert f"set {missing}" in proc.stderr


# --------------------------------------------------------------------------- CPU hosts


@needs_compose
@pytest.mark.parametrize("name", ["compose.cpu.yaml", "compose.fleet.cpu.yaml"])
def test_the_cpu_files_ask_for_no_gpu_udev_or_memlock(tmp_path: Path, name: str) -> None:
    env = TOKENS | {"TIERD_FLEET_TOKEN": "fleet-secret", "TIERD_PG_PASSWORD": "pg-secret"}
    proc = compose_config(env, tmp_path, DOCKER / name)
    assert proc.returncode == 0, proc.stderr
    yaml = pytest.importorskip("yaml")
    services = yaml.safe_load(proc.stdout)["services"]
    tierds = [s for n, s in services.items() if n.startswith("tierd")]
    assert tierds
    for service in tierds:
        assert "deploy" not in service and "ulimits" not in service
        assert not any("/run/udev" in str(v) for v in service.get("volumes", []))
        assert service["build"]["args"]["EXTRAS"] == "server"
    for service in services.values():  # every image is one CI can build (docker/ci)
        assert "nvidia" not in str(service.get("image", ""))


@needs_compose
def test_the_gpu_file_passes_the_build_arguments(tmp_path: Path) -> None:
    proc = compose_config(TOKENS | {"TIERD_EXTRAS": "server,gpu"}, tmp_path)
    yaml = pytest.importorskip("yaml")
    args = yaml.safe_load(proc.stdout)["services"]["tierd"]["build"]["args"]
    assert args == {"BASE_IMAGE": "nvidia/cuda:13.0.1-runtime-ubuntu24.04", "EXTRAS": "server,gpu"}
