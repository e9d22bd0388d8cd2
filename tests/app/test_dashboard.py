"""The dashboard: the page and its assets, the read-only endpoints it adds (``/v1/stats/history``
and ``/v1/heat``), and the page itself in a real headless Chromium against a real server."""

from __future__ import annotations

import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

import app.ui
from app.api.history import StatsRecorder
from app.main import create_app
from app.ui import ASSETS
from tests.conftest import LiveServer, make_settings, wait_for
from tests.helpers import SHM, chromium, chromium_options

MiB = 1 << 20
ADMIN = "admin-token-for-the-dashboard-test"
DATA = "data-token-for-the-dashboard-test"
# Read at import: the autouse _clean_env fixture removes every TIERD_* variable before a test.
SCREENSHOT_DIR = os.environ.get("TIERD_SCREENSHOT_DIR")
STATIC = Path(app.ui.__file__).parent / "static"


def _put(api: Any, path: str, data: bytes, tier: str) -> int:
    r = api.put("/v1/files/content", params={"path": path, "tier": tier}, content=data)
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


# -- the page and its assets ---------------------------------------------------------------------
@pytest.mark.parametrize("url", ["/", "/ui", "/ui/"])
def test_page_is_served_at_root_and_ui(client: TestClient, url: str) -> None:
    r = client.get(url)
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    html = r.text
    assert '<script src="/ui/app.js" defer></script>' in html
    assert html.count("<script") == 1  # no inline script: the CSP would refuse it
    assert not re.search(r"<[^>]*\son[a-z]+\s*=", html)  # no inline event handlers either


@pytest.mark.parametrize(
    ("name", "ctype"),
    [
        ("app.js", "text/javascript; charset=utf-8"),
        ("style.css", "text/css; charset=utf-8"),
        ("favicon.svg", "image/svg+xml"),
        ("index.html", "text/html; charset=utf-8"),
    ],
)
def test_assets_are_served_with_their_content_type(
    client: TestClient, name: str, ctype: str
) -> None:
    r = client.get(f"/ui/{name}")
    assert r.status_code == 200
    assert r.headers["content-type"] == ctype
    assert r.headers["content-security-policy"]
    assert r.headers["cache-control"] == "no-cache"
    assert r.content == (STATIC / name).read_bytes()


@pytest.mark.parametrize("name", ["nope.js", "..%2F__init__.py", "%2E%2E%2Fapp.js", "static"])
def test_only_listed_assets_are_served(client: TestClient, name: str) -> None:
    r = client.get(f"/ui/{name}")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"
    assert set(ASSETS) == {p.name for p in STATIC.iterdir()}


def test_openapi_has_the_new_endpoints_and_not_the_page(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    paths = spec["paths"]
    assert "/" not in paths and "/ui" not in paths and "/ui/{name}" not in paths
    hist = paths["/v1/stats/history"]["get"]["responses"]["200"]["content"]["application/json"]
    assert hist["schema"]["$ref"].endswith("/StatsHistory")
    heat = paths["/v1/heat"]["get"]["responses"]["200"]["content"]["application/json"]
    assert heat["schema"]["$ref"].endswith("/HeatOut")
    assert "HistorySlice" in spec["components"]["schemas"]


# -- auth ------------------------------------------------------------------------------------------
@pytest.fixture
def token_client(data_dir: Path) -> Iterator[TestClient]:
    settings = make_settings(data_dir, watch=False, admin_token=ADMIN, data_token=DATA)
    with TestClient(create_app(settings), base_url="http://127.0.0.1") as c:
        yield c


def test_page_needs_no_token_but_its_data_does(token_client: TestClient) -> None:
    c = token_client
    assert c.get("/").status_code == 200
    assert c.get("/ui/app.js").status_code == 200
    for url in ("/v1/stats/history", "/v1/heat"):
        r = c.get(url)
        assert r.status_code == 401, url
        assert r.json()["error"]["code"] == "unauthorized"
        assert c.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get(url, headers={"Authorization": f"Bearer {DATA}"}).status_code == 200
        assert c.get(url, headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200


def test_role_probe_the_page_relies_on(token_client: TestClient) -> None:
    """The page tells the admin token from the data token by a dry-run plan with a body that is
    not a policy: 403 for the data token, 422 for the admin token, and nothing changes."""

    def probe(token: str) -> int:
        headers = {"Authorization": f"Bearer {token}"}
        r = token_client.post("/v1/policy/plan", json="role-probe", headers=headers)
        return r.status_code

    assert probe(DATA) == 403
    assert probe(ADMIN) == 422
    ver = token_client.get("/v1/policy", headers={"Authorization": f"Bearer {DATA}"})
    assert ver.json()["version"] == 0


# -- /v1/stats/history ---------------------------------------------------------------------------
class _Counters:
    """Cumulative counters as ``GdsStatsSnapshot.to_dict()`` has them, advanced by hand."""

    def __init__(self) -> None:
        self.doc: dict[str, Any] = self._slice(0, 0, 0.0, 0.0)
        self.doc.update(by_path={}, by_tier={})

    @staticmethod
    def _slice(nbytes: int, ops: int, lat_us: float, busy_s: float) -> dict[str, Any]:
        return {
            "bytes_transferred": nbytes,
            "operations_completed": ops,
            "operations_failed": 0,
            "peak_bandwidth_gbps": 0.0,
            "avg_latency_us": lat_us,
            "effective_bandwidth_gbps": nbytes / busy_s / 1e9 if busy_s else 0.0,
        }

    def set(self, nbytes: int, ops: int, lat_us: float, busy_s: float, tier: str = "nvme") -> None:
        s = self._slice(nbytes, ops, lat_us, busy_s)
        self.doc = {**s, "by_path": {"host": dict(s)}, "by_tier": {tier: dict(s)}}


def test_recorder_turns_samples_into_per_minute_deltas() -> None:
    now = [1_000_000.0]
    c = _Counters()
    rec = StatsRecorder(lambda: c.doc, step_s=60, keep=3, clock=lambda: now[0])
    rec.sample()  # what start() takes first
    c.set(6_000_000, 3, 100.0, 1.0)
    now[0] += 60
    rec.sample()
    c.set(9_000_000, 5, 160.0, 2.5)  # 2 more loads, 3 MB, whose mean latency was 250 us
    now[0] += 15
    h = rec.history()
    assert [p.partial for p in h.points] == [False, True]
    first, live = h.points
    assert first.seconds == 60 and first.total.bytes == 6_000_000 and first.total.operations == 3
    assert first.total.throughput_bps == 100_000.0
    assert first.total.avg_latency_us == pytest.approx(100.0)
    assert first.by_tier["nvme"].bytes == 6_000_000 and first.by_path["host"].operations == 3
    assert live.seconds == 15 and live.total.bytes == 3_000_000 and live.total.operations == 2
    assert live.total.avg_latency_us == pytest.approx(250.0)
    assert live.total.throughput_bps == 200_000.0
    assert live.total.effective_gbps == pytest.approx(0.002)  # 3 MB over 1.5 s busy
    # A reset (counters go down) counts what came after it, never a negative delta.
    rec.sample()
    c.set(1_000, 1, 50.0, 0.001, tier="hdd")
    now[0] += 60
    last = rec.history().points[-1]
    assert last.total.bytes == 1_000 and last.total.operations == 1
    assert set(last.by_tier) == {"hdd"}  # nvme had no loads in this interval
    # The ring keeps ``keep`` intervals: older samples fall off.
    for _ in range(10):
        now[0] += 60
        rec.sample()
    h = rec.history()
    assert len(h.points) == 3 + 1
    assert h.since.timestamp() == now[0] - 3 * 60


def test_history_shows_a_load_at_once_and_stops_its_thread(data_dir: Path) -> None:
    if not SHM.is_dir() or not os.access(SHM, os.W_OK):
        pytest.skip("/dev/shm is not writable here (cpu loads need it)")
    settings = make_settings(data_dir, watch=False)
    before = set(threading.enumerate())  # only this app's sampler counts (not another's)

    def samplers() -> list[threading.Thread]:
        new = set(threading.enumerate()) - before
        return [t for t in new if t.name == "tierd-stats-history" and t.is_alive()]

    with TestClient(create_app(settings), base_url="http://127.0.0.1") as c:
        assert samplers()
        fid = _put(c, "a/b.bin", os.urandom(3 * MiB + 5), "ssd")
        lease = c.post("/v1/load", json={"file_id": fid, "device": "cpu"})
        assert lease.status_code == 200, lease.text
        h = c.get("/v1/stats/history").json()
        assert h["step_s"] == 60
        last = h["points"][-1]
        assert last["partial"] is True
        assert last["total"]["bytes"] == 3 * MiB + 5 and last["total"]["operations"] == 1
        assert last["by_tier"]["ssd"]["operations"] == 1
        assert last["total"]["avg_latency_us"] > 0 and last["total"]["throughput_bps"] > 0
        assert c.get("/v1/stats/history", params={"minutes": 0}).status_code == 422
        assert c.delete(f"/v1/buffers/{lease.json()['buffer_id']}").status_code == 200
    # The lifespan stopped the sampler (the autouse fixture fails a leaked thread, too).
    assert not samplers()


# -- /v1/heat ------------------------------------------------------------------------------------
def test_heat_lists_the_hottest_files_and_a_histogram_per_tier(client: TestClient) -> None:
    ids = {
        name: _put(client, f"h/{name}", name.encode() * 10, tier)
        for name, tier in [("a", "nvme"), ("b", "ssd"), ("c", "ssd"), ("d", "hdd")]
    }
    for name, reads in [("b", 5), ("c", 2), ("d", 1)]:
        for _ in range(reads):
            assert client.get(f"/v1/files/{ids[name]}/content").status_code == 200

    def hot() -> Any:
        body = client.get("/v1/heat", params={"top": 3}).json()
        total = sum(f["heat"] for f in body["hottest"])
        return body if total > 7.9 else None  # all 8 reads flushed (heat decays a little)

    body = wait_for(hot, what="accesses to be flushed")
    assert [f["path"] for f in body["hottest"]] == ["h/b", "h/c", "h/d"]
    assert list(body["tiers"]) == ["nvme", "ssd", "hdd"]
    assert body["edges"][0] == 0 and body["edges"] == sorted(body["edges"])
    assert {n: t["files"] for n, t in body["tiers"].items()} == {"nvme": 1, "ssd": 2, "hdd": 1}
    for t in body["tiers"].values():
        assert sum(t["counts"]) == t["files"] and len(t["counts"]) == len(body["edges"])
    # heat 5 falls in the bucket [3, 10); heat 0 in the first.
    ssd = body["tiers"]["ssd"]["counts"]
    assert ssd[body["edges"].index(3.0)] == 1
    assert body["tiers"]["nvme"]["counts"][0] == 1
    assert client.get("/v1/heat", params={"top": 0}).json()["hottest"] == []
    assert client.get("/v1/heat", params={"top": 501}).status_code == 422


# -- the page in a real browser ------------------------------------------------------------------
def _browser() -> tuple[Any, str, str]:
    """selenium, the chromium binary and chromedriver, or a skip saying which is missing."""
    return chromium()


@pytest.fixture
def dash_server(data_dir: Path) -> Iterator[LiveServer]:
    tiers = [
        {"name": "nvme", "path": data_dir / "nvme", "quota_bytes": 24 * MiB},
        {"name": "ssd", "path": data_dir / "ssd", "quota_bytes": 64 * MiB},
        {"name": "hdd", "path": data_dir / "hdd"},
    ]
    settings = make_settings(
        data_dir,
        tiers=tiers,
        watch=False,
        admin_token=ADMIN,
        data_token=DATA,
        buffers={"cpu_budget_bytes": 256 * MiB},
    )
    with LiveServer(settings) as srv:
        yield srv


def _populate(srv: LiveServer) -> dict[str, Any]:
    """Files on every tier with some heat, finished moves, a slow move in flight and a live
    cpu lease (plus a few released ones, for the charts)."""
    admin = srv.client(ADMIN)
    data = srv.client(DATA)
    files = {
        "models/llama-3-8b/model-00001-of-00002.safetensors": ("nvme", 3 * MiB, 40),
        "models/llama-3-8b/model-00002-of-00002.safetensors": ("nvme", 2 * MiB, 28),
        "models/llama-3-8b/tokenizer.json": ("nvme", 180_000, 12),
        "emb/users.f16": ("ssd", 4 * MiB, 7),
        "emb/items.f16": ("ssd", 2 * MiB, 4),
        "datasets/eval/shard-000.parquet": ("ssd", 600_000, 1),
        "checkpoints/run-17/step-12000.pt": ("hdd", 5 * MiB, 0),
        "checkpoints/run-17/step-11000.pt": ("hdd", 5 * MiB, 0),
        "logs/train-2026-11-20.jsonl": ("hdd", 90_000, 2),
    }
    ids = {}
    for path, (tier, size, reads) in files.items():
        ids[path] = _put(admin, path, os.urandom(size), tier)
        for _ in range(reads):
            assert data.get(f"/v1/files/{ids[path]}/content").status_code == 200
    # A finished move, for the history.
    r = admin.post(
        "/v1/migrations",
        params={"wait": "true"},
        json={"file_id": ids["logs/train-2026-11-20.jsonl"], "to_tier": "ssd"},
    )
    assert r.status_code == 200, r.text
    # Loads of every tier, released (the charts), and one live cpu lease (the leases card).
    for path in list(files)[::2]:
        lease = data.post("/v1/load", json={"path": path, "device": "cpu"}).json()
        assert data.delete(f"/v1/buffers/{lease['buffer_id']}").status_code == 200
    live = data.post(
        "/v1/load",
        json={"path": "models/llama-3-8b/model-00001-of-00002.safetensors", "device": "cpu"},
    )
    assert live.status_code == 200, live.text
    # A lease whose file was deleted since: it lives on (the client's), shown as on a gone file.
    orphan = data.post(
        "/v1/load", json={"path": "datasets/eval/shard-000.parquet", "device": "cpu"}
    )
    assert orphan.status_code == 200, orphan.text
    gone = ids["datasets/eval/shard-000.parquet"]
    assert admin.delete(f"/v1/files/{gone}").status_code == 200
    # A slow move in flight: 12 MiB at 0.5 MiB/s, cancelled when the server stops.
    policy = admin.get("/v1/policy").json()["policy"]
    policy.update(bandwidth_bytes_per_s=MiB // 2, min_age_s=86400, interval_s=3600)
    assert admin.put("/v1/policy", json=policy).status_code == 200
    big = _put(admin, "models/mixtral/consolidated.00.pt", os.urandom(12 * MiB), "hdd")
    r = admin.post("/v1/migrations", json={"file_id": big, "to_tier": "nvme"})
    assert r.status_code == 202, r.text
    move_id = r.json()["migrations"][0]["id"]
    wait_for(
        lambda: admin.get("/v1/migrations", params={"state": "in_flight"}).json()["items"],
        what="the move to start",
    )
    admin.close()
    data.close()
    return {
        "lease": live.json()["buffer_id"],
        "orphan": orphan.json()["buffer_id"],
        "move": move_id,
        "hot": ids,
    }


def _save_screenshot(driver: Any, tmp_path: Path, name: str) -> Path:
    # The whole page: a viewport as tall as the page, 1440 CSS pixels wide.
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    metrics = {"width": 1440, "height": height, "deviceScaleFactor": 1, "mobile": False}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
    wait_for(  # the page redraws its charts for the new width
        lambda: driver.find_element("tag name", "body").get_attribute("data-width") == "1440",
        what="the page to redraw",
    )
    out = tmp_path / name
    assert driver.save_screenshot(str(out)), "screenshot failed"
    driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    if SCREENSHOT_DIR:
        Path(SCREENSHOT_DIR).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out, Path(SCREENSHOT_DIR) / name)
    return out


@pytest.fixture
def browser() -> tuple[Any, str, str]:
    """Before the server fixture, so that a machine without a browser skips at once."""
    return _browser()


def test_dashboard_in_a_real_browser(
    browser: tuple[Any, str, str],
    host_network: None,
    dash_server: LiveServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    webdriver, chrome, chromedriver = browser
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    seen = _populate(dash_server)

    opts = chromium_options(
        webdriver,
        chrome,
        tmp_path / "chrome-profile",
        "--window-size=1440,1000",
        "--force-device-scale-factor=1",
    )
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Selenium Manager must not go looking for a driver on the internet.
    monkeypatch.setenv("SE_OFFLINE", "true")
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=chromedriver))
    try:
        wait = WebDriverWait(driver, 15)
        driver.get(dash_server.url + "/")
        # Tokens are configured: the page asks for one.
        wait.until(ec.visibility_of_element_located((By.ID, "login")))
        # A wrong token is refused, and the page asks again.
        driver.find_element(By.ID, "token").send_keys("not-a-token")
        driver.find_element(By.ID, "login-submit").click()
        wait.until(ec.visibility_of_element_located((By.ID, "login-error")))
        assert "refused" in driver.find_element(By.ID, "login-error").text
        driver.find_element(By.ID, "token").send_keys(DATA)
        driver.find_element(By.ID, "login-submit").click()
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-role"))

        def text(el_id: str) -> str:
            return str(driver.find_element(By.ID, el_id).text)

        wait.until(lambda d: "mixtral" in text("moves-inflight"))
        assert driver.find_element(By.TAG_NAME, "body").get_attribute("data-role") == "data"
        # Tiers: every tier, its backend kind and file count.
        for tier in ("nvme", "ssd", "hdd"):
            row = driver.find_element(By.CSS_SELECTOR, f'#tiers [data-tier="{tier}"]')
            assert "directory" in row.text and "files" in row.text
        # The hottest file first, and a histogram per tier.
        first = driver.find_elements(By.CSS_SELECTOR, "#hot tbody tr")[0]
        assert "model-00001-of-00002.safetensors" in first.text
        assert len(driver.find_elements(By.CSS_SELECTOR, "#heat .heat-tier svg")) == 3
        # The move in flight with its progress, and the finished one.
        move = driver.find_element(By.CSS_SELECTOR, f'[data-migration-id="{seen["move"]}"]')
        assert "consolidated.00.pt" in move.text and "of 12.0 MiB" in move.text
        assert "train-2026-11-20.jsonl" in text("moves-recent")
        assert "done" in text("moves-recent")
        # The live lease against the cpu budget.
        lease = driver.find_element(By.CSS_SELECTOR, f'[data-buffer-id="{seen["lease"]}"]')
        assert "cpu" in lease.text and not lease.find_elements(By.CSS_SELECTOR, "[data-deleted]")
        orphan = driver.find_element(By.CSS_SELECTOR, f'[data-buffer-id="{seen["orphan"]}"]')
        gone = seen["hot"]["datasets/eval/shard-000.parquet"]
        deleted = orphan.find_element(By.CSS_SELECTOR, "[data-deleted]")
        assert deleted.text == f"#{gone} deleted"
        assert "of 256 MiB budget" in text("budgets")
        # The charts drew the loads made a moment ago.
        assert driver.find_elements(By.CSS_SELECTOR, "#chart-throughput svg rect")
        assert driver.find_elements(By.CSS_SELECTOR, "#chart-latency svg circle")
        # Ready, and the watcher's state (off in this server).
        assert text("ready") == "ready"
        assert "watcher" in text("watcher")
        # The data token sees no admin action.
        assert not driver.find_element(By.ID, "run-plan").is_displayed()
        assert not driver.find_elements(By.CSS_SELECTOR, "#hot .pin-action")
        # The token lives in sessionStorage only, never in the URL or localStorage.
        assert driver.execute_script("return sessionStorage.getItem('tierd.token')") == DATA
        assert driver.execute_script("return localStorage.length") == 0
        assert DATA not in driver.current_url
        _save_screenshot(driver, tmp_path, "dashboard.png")

        # Forget the data token, sign in with the admin token: admin actions appear and work.
        driver.find_element(By.ID, "signout").click()
        wait.until(ec.visibility_of_element_located((By.ID, "login")))
        driver.find_element(By.ID, "token").send_keys(ADMIN)
        driver.find_element(By.ID, "login-submit").click()
        wait.until(
            lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-role") == "admin"
        )
        wait.until(lambda d: d.find_element(By.ID, "run-plan").is_displayed())
        pin = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#hot .pin-action"))
        pin[0].click()
        fid = seen["hot"]["models/llama-3-8b/model-00001-of-00002.safetensors"]
        with dash_server.client(DATA) as api:
            wait_for(
                lambda: api.get(f"/v1/files/{fid}").json()["pinned_tier"] == "nvme",
                what="the pin",
            )
        # No CSP violation and no script error in the console.
        errors = [
            e["message"]
            for e in driver.get_log("browser")
            if e["level"] == "SEVERE" or "Content Security Policy" in e["message"]
        ]
        # Chrome logs every 4xx: the 401s that made the page ask for a token, and the role
        # probe's 403 (data token) and 422 (admin token) are expected; nothing else is.
        expected = ("status of 401", "/v1/policy/plan - Failed to load resource")
        assert [m for m in errors if not any(x in m for x in expected)] == []
    finally:
        driver.quit()
