"""The monitoring files of docker/: Prometheus rules, their unit tests, the Grafana board and
the compose profile that runs them.

The promtool tests and the live test need Prometheus (Debian: `apt-get install prometheus`,
which brings `promtool`); they skip where it is absent. The live test serves the real app on a
loopback port, gives it some traffic, starts a real `prometheus` scraping it every second with
rules.yml loaded, and evaluates every expression of rules.yml and of the board through
Prometheus' HTTP API.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import LiveServer, free_port, make_settings, wait_for
from tests.helpers import SHM

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read the monitoring files")

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
PROM_DIR = DOCKER / "prometheus"
RULES = PROM_DIR / "rules.yml"
RULES_TEST = PROM_DIR / "rules_test.yml"
PROM_CONFIG = PROM_DIR / "prometheus.yml"
GRAFANA = DOCKER / "grafana"
BOARD = GRAFANA / "tierd.json"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARDS = GRAFANA / "provisioning" / "dashboards" / "tierd.yml"
COMPOSE = DOCKER / "compose.yaml"

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
DOCKER_COMPOSE = shutil.which("docker-compose")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus)"
)
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus is not installed (apt-get install prometheus)"
)

# Gauges the rules and the board read that tierd does not export yet (see rules.yml): the
# expressions using them evaluate to nothing until they exist.
NOT_EXPORTED_YET: set[str] = set()
SEVERITIES = {"critical", "warning", "info"}
# Values for Grafana's variables when an expression of the board is sent to Prometheus as is.
GRAFANA_VARIABLES = {
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "1h",
    "instance": ".*",
}


# --------------------------------------------------------------------------- helpers


def rule_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = yaml.safe_load(RULES.read_text())["groups"]
    return groups


def rules() -> list[dict[str, Any]]:
    return [rule for group in rule_groups() for rule in group["rules"]]


def alerts() -> list[dict[str, Any]]:
    return [rule for rule in rules() if "alert" in rule]


def board() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(BOARD.read_text())
    return data


def board_panels() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for panel in board()["panels"]:
        out.append(panel)
        out += panel.get("panels", [])  # panels of a collapsed row
    return out


def board_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the board, Grafana variables substituted."""
    return [
        (panel["title"], grafana_to_promql(target["expr"]))
        for panel in board_panels()
        for target in panel.get("targets", [])
    ]


def grafana_to_promql(expr: str) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        assert name in GRAFANA_VARIABLES, f"unknown Grafana variable ${name} in {expr}"
        return GRAFANA_VARIABLES[name]

    out = re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", sub, expr)
    assert "$" not in out, out
    return out


def metric_names(expr: str) -> set[str]:
    """tierd metric names an expression reads (recording rules' names contain ':')."""
    return {m for m in re.findall(r"(?<![\w:])tierd_\w+(?![\w:])", expr)}


def exported_series(metrics_text: str) -> set[str]:
    """Series names /metrics can produce, from its # TYPE lines (even for families with no
    sample yet, such as tierd_migrations before the first move)."""
    suffixes = {
        "counter": ("_total",),
        "histogram": ("_bucket", "_sum", "_count"),
        "summary": ("_sum", "_count"),
    }
    names: set[str] = set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            names.update(name + s for s in suffixes.get(kind, ()))
    return names


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


# --------------------------------------------------------------------------- rules.yml


def test_every_alert_has_for_severity_and_annotations() -> None:
    names = [rule["alert"] for rule in alerts()]
    assert len(names) == len(set(names)), names
    for rule in alerts():
        name = rule["alert"]
        assert re.fullmatch(r"\d+[smh]", str(rule.get("for", ""))), f"{name}: no for:"
        assert rule["labels"]["severity"] in SEVERITIES, name
        annotations = rule["annotations"]
        assert annotations["summary"].strip() and "\n" not in annotations["summary"], name
        assert len(annotations["description"]) > 80, f"{name}: description too short"
    # the situations the service must page or warn about
    assert {
        "TierdDown",
        "TierdTierOverHighWatermark",
        "TierdMigrationFailed",
        "TierdLeasesNearBudget",
        "TierdWatcherDegraded",
        "TierdLoadsSlow",
        "TierdCatalogBusy",
    } <= set(names)


def test_recording_rules_follow_the_naming_convention_and_keep_instance() -> None:
    recorded = [rule for rule in rules() if "record" in rule]
    assert recorded
    for rule in recorded:
        assert re.fullmatch(r"[a-z_]+:tierd_[a-z0-9_]+:[a-z0-9_]+", rule["record"]), rule
        # aggregations keep instance and job, so several hosts stay apart
        for by in re.findall(r"by \(([^)]*)\)", rule["expr"]):
            labels = {label.strip() for label in by.split(",")}
            assert {"instance", "job"} <= labels, (rule["record"], by)


def test_every_alert_has_unit_tests() -> None:
    tests = yaml.safe_load(RULES_TEST.read_text())
    assert tests["rule_files"] == [RULES.name]
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in tests["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {rule["alert"] for rule in alerts()}
    assert names <= fired, f"no firing case for {names - fired}"
    assert names <= quiet, f"no quiet case for {names - quiet}"


def test_rules_and_board_read_only_metrics_tierd_exports(client: Any) -> None:
    """A renamed metric in app/metrics.py must not silently empty an alert or a panel."""
    exported = exported_series(client.get("/metrics").text)
    assert "tierd_http_requests_total" in exported
    assert not NOT_EXPORTED_YET & exported, "now exported: drop it from NOT_EXPORTED_YET"
    used: dict[str, set[str]] = {}
    for rule in rules():
        for name in metric_names(rule["expr"]):
            used.setdefault(name, set()).add(rule.get("alert") or rule["record"])
    for title, expr in board_exprs():
        for name in metric_names(expr):
            used.setdefault(name, set()).add(f"panel {title!r}")
    unknown = {name: users for name, users in used.items() if name not in exported}
    assert set(unknown) <= NOT_EXPORTED_YET, unknown


@needs_promtool
def test_promtool_checks_the_rules() -> None:
    assert PROMTOOL is not None
    proc = subprocess.run(
        [PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules())} rules found" in proc.stdout + proc.stderr


@needs_promtool
def test_promtool_unit_tests_of_the_rules_pass() -> None:
    assert PROMTOOL is not None
    proc = subprocess.run(
        [PROMTOOL, "test", "rules", str(RULES_TEST)],
        cwd=PROM_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr


@needs_promtool
def test_promtool_checks_the_prometheus_config(tmp_path: Path) -> None:
    """prometheus.yml names the rules where compose mounts them; point it at the repo's."""
    config = yaml.safe_load(PROM_CONFIG.read_text())
    assert config["rule_files"] == ["/etc/prometheus/rules.yml"]
    config["rule_files"] = [str(RULES)]
    local = tmp_path / "prometheus.yml"
    local.write_text(yaml.safe_dump(config))
    assert PROMTOOL is not None
    proc = subprocess.run(
        [PROMTOOL, "check", "config", str(local)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --------------------------------------------------------------------------- config, grafana


def test_prometheus_scrapes_the_tierd_service_of_compose() -> None:
    config = yaml.safe_load(PROM_CONFIG.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    tierd = jobs["tierd"]  # the job name the rules match on
    assert tierd.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in tierd["static_configs"] for t in sc["targets"]]
    assert targets == ["tierd:8470"]
    assert "tierd" in compose()["services"]
    assert 'job="tierd"' in RULES.read_text()


def test_grafana_board_is_well_formed() -> None:
    data = board()
    assert data["uid"] == "tierd" and data["title"]
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in board_panels()]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in board_panels():
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
        # every Grafana variable used is one the test knows how to substitute
        for target in panel["targets"]:
            grafana_to_promql(target["expr"])
    exprs = " ".join(expr for _, expr in board_exprs())
    # what the board must show
    for metric in (
        "tierd_catalog_bytes",
        "tierd_loaded_bytes_total",
        "tierd_load_duration_seconds_bucket",
        "tierd_migrations_total",
        "tierd_leased_bytes",
        "tierd_lease_budget_bytes",
        "tierd_http_requests_total",
        "tierd_watcher_healthy",
    ):
        assert metric in exprs, metric


def test_grafana_provisioning_matches_compose() -> None:
    services = compose()["services"]
    datasource = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"
    assert "prometheus" in services
    provider = yaml.safe_load(DASHBOARDS.read_text())["providers"][0]
    board_dir = provider["options"]["path"]
    mounts = services["grafana"]["volumes"]
    assert f"./grafana/tierd.json:{board_dir}/tierd.json:ro" in mounts
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in mounts


# --------------------------------------------------------------------------- compose.yaml


def test_compose_monitoring_profile() -> None:
    services = compose()["services"]
    assert "profiles" not in services["tierd"], "tierd must run without a profile"
    images = {"prometheus": r"prom/prometheus:v\d+\.\d+\.\d+", "grafana": r"grafana/grafana:\d+"}
    for name, image in images.items():
        service = services[name]
        assert service["profiles"] == ["monitoring"], name
        # pinned to a release, never latest
        assert re.fullmatch(image + r"(\.\d+)*(@sha256:[0-9a-f]{64})?", service["image"]), name
        # published on loopback unless the operator says otherwise
        for port in service["ports"]:
            default = re.fullmatch(r"\$\{\w+:-([^}]*)\}:\d+", port)
            assert default and default.group(1).startswith("127.0.0.1:"), port
        # configuration is mounted read-only; only the named data volume is writable
        for volume in service["volumes"]:
            if volume.startswith("./"):
                assert volume.endswith(":ro"), volume
    prometheus = services["prometheus"]
    assert "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    assert "./prometheus/rules.yml:/etc/prometheus/rules.yml:ro" in prometheus["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    assert {"prometheus", "grafana"} <= set(compose()["volumes"])


@pytest.mark.skipif(DOCKER_COMPOSE is None, reason="docker-compose is not installed")
def test_compose_renders_the_monitoring_profile(tmp_path: Path) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TIERD_", "COMPOSE_", "PROMETHEUS_", "GRAFANA_"))
    }
    env.update(TIERD_ADMIN_TOKEN="admin-secret", TIERD_DATA_TOKEN="data-secret")
    empty = tmp_path / "empty.env"
    empty.write_text("")
    assert DOCKER_COMPOSE is not None
    base = [DOCKER_COMPOSE, "--env-file", str(empty), "-f", str(COMPOSE)]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*base, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )

    plain = run("config", "--quiet")
    assert plain.returncode == 0, plain.stderr
    proc = run("--profile", "monitoring", "config")
    assert proc.returncode == 0, proc.stderr
    rendered = yaml.safe_load(proc.stdout)["services"]
    assert set(rendered) == {"tierd", "prometheus", "grafana"}
    assert "127.0.0.1:9090:9090" in proc.stdout
    assert "127.0.0.1:3000:3000" in proc.stdout
    assert "docker/prometheus/rules.yml:/etc/prometheus/rules.yml:ro" in proc.stdout


# --------------------------------------------------------------------------- live


class Prometheus:
    """A real prometheus on a loopback port, scraping ``target`` every second with rules.yml;
    its temp directory (config, TSDB, log) is removed when it stops."""

    def __init__(self, target: str) -> None:
        assert PROMETHEUS is not None
        self.dir = Path(tempfile.mkdtemp(prefix="tierd-prometheus-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "tierd", "static_configs": [{"targets": [target]}]}],
        }
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = self.dir / "prometheus.log"
        self.args = [
            PROMETHEUS,
            f"--config.file={self.dir / 'prometheus.yml'}",
            f"--storage.tsdb.path={self.dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Prometheus:
        try:
            with self.log.open("wb") as log:
                self.proc = subprocess.Popen(
                    self.args, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir
                )
            wait_for(self._ready, timeout=30, what="prometheus to be ready")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited {self.proc.returncode}:\n{self.log_tail()}")
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def get(self, path: str, **params: str) -> dict[str, Any]:
        resp = httpx.get(f"{self.url}{path}", params=params, timeout=10)
        body: dict[str, Any] = resp.json()
        assert resp.status_code == 200 and body["status"] == "success", (path, params, body)
        return body["data"]  # type: ignore[no-any-return]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        result: list[dict[str, Any]] = data["result"]
        return result

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None


@pytest.fixture
def traffic_server(tmp_path: Path) -> Iterator[LiveServer]:
    """The real app on a loopback port, after an upload, a load into cpu and a 404."""
    if not SHM.is_dir() or not os.access(SHM, os.W_OK):
        pytest.skip("/dev/shm is not writable here (cpu loads need it)")
    settings = make_settings(tmp_path / "data")
    with LiveServer(settings) as srv, srv.client() as http:
        put = http.put(
            "/v1/files/content",
            params={"path": "models/m.bin", "tier": "ssd"},
            content=os.urandom(256 * 1024),
        )
        assert put.status_code == 201, put.text
        load = http.post("/v1/load", json={"path": "models/m.bin", "device": "cpu"})
        assert load.status_code == 200, load.text
        assert http.get("/v1/files/999999").status_code == 404
        try:
            yield srv
        finally:
            http.delete(f"/v1/buffers/{load.json()['buffer_id']}")


@needs_prometheus
def test_rules_and_board_evaluate_against_a_real_prometheus(traffic_server: LiveServer) -> None:
    target = f"127.0.0.1:{traffic_server.settings.port}"
    started = time.monotonic()
    with Prometheus(target) as prom:
        try:
            # the target is up and has been scraped a few times (rates need two samples)
            def scraped() -> bool:
                targets = prom.get("/api/v1/targets")["activeTargets"]
                return (
                    any(t["labels"]["job"] == "tierd" and t["health"] == "up" for t in targets)
                    and (prom.value('count_over_time(up{job="tierd"}[1m])') or 0) >= 3
                )

            wait_for(scraped, timeout=30, what="prometheus to scrape tierd")

            # every rule loaded, and evaluated without error (recording rules on real series)
            names = {r.get("alert") or r["record"] for r in rules()}

            def evaluated() -> list[dict[str, Any]] | None:
                got = [r for g in prom.get("/api/v1/rules")["groups"] for r in g["rules"]]
                # "0001-01-01T00:00:00Z" until the rule's first evaluation
                done = {r["name"] for r in got if not r["lastEvaluation"].startswith("0001")}
                return got if done >= names else None

            loaded = wait_for(evaluated, timeout=20, what="every rule to be evaluated")
            assert {r["name"] for r in loaded} == names
            for r in loaded:
                assert r["health"] == "ok" and not r.get("lastError"), r

            # every expression of rules.yml and of the board is valid PromQL for Prometheus
            for rule in rules():
                prom.query(rule["expr"])
            for _title, expr in board_exprs():
                prom.query(expr)

            # and the basic series have data
            assert prom.value(f'up{{job="tierd", instance="{target}"}}') == 1
            assert prom.value(
                'sum(tierd_http_requests_total{route="/v1/files/content", '
                'method="PUT", status="201"})'
            ) == pytest.approx(1)
            assert prom.value('sum(tierd_http_requests_total{status="404"})') == pytest.approx(1)
            assert prom.value(
                'sum(tierd_loaded_bytes_total{op="load", device="cpu", tier="ssd"})'
            ) == pytest.approx(256 * 1024)
            assert prom.value('tierd_catalog_files{tier="ssd"}') == 1
            assert (prom.value('sum(tierd_leased_bytes{device="cpu"})') or 0) >= 256 * 1024
            assert (prom.value('sum(tierd_lease_budget_bytes{device="cpu"})') or 0) > 0
            # a recording rule over real series
            assert prom.query('instance_tier_io_path:tierd_loaded_bytes:rate5m{tier="ssd"}')
            # tierd healthy and idle: nothing fires
            firing = prom.query('ALERTS{alertstate="firing"}')
            assert not firing, firing
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- prometheus log ---\n{prom.log_tail()}") from exc
    assert not prom.dir.exists()
    assert prom.proc is not None and prom.proc.returncode is not None
    assert time.monotonic() - started < 60


def test_tier_limits_and_watcher_health_are_exported(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from app.main import create_app
    from app.settings import get_settings

    root = tmp_path / "data"
    tiers = [
        {"name": "nvme", "path": root / "nvme", "quota_bytes": 1 << 30},
        {"name": "hdd", "path": root / "hdd"},
    ]
    settings = get_settings(data_dir=root, tiers=tiers, watch=True)
    with TestClient(create_app(settings), base_url="http://127.0.0.1") as c:
        text = c.get("/metrics").text
    assert 'tierd_tier_quota_bytes{tier="nvme"} 1.073741824e+09' in text
    assert 'tierd_tier_high_watermark_ratio{tier="nvme"} 0.9' in text
    assert 'tier="hdd"' not in "".join(ln for ln in text.splitlines() if "quota" in ln)
    assert "tierd_watcher_healthy 1.0" in text
