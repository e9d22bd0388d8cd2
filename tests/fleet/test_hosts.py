"""Hosts in the shared catalog: registration and heartbeat, ``down`` by the heartbeat's age with
the records kept, each host's directory tiers attributed to it, and where a file is, warmest
first. Two engines with their own host ids and data directories on one PostgreSQL catalog;
one engine on SQLite."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from app.settings import Settings
from tests.catalog.conftest import run_sql
from tests.conftest import wait_for
from tests.helpers import engine_settings, payload, put
from tiering.catalog import Copies
from tiering.catalog.hosts import Hosts
from tiering.engine import Engine
from tiering.fleet import fleet_hosts, locate


def _settings(root: Path, host: str, **kw: Any) -> Settings:
    return engine_settings(
        root,
        host_id=host,
        advertise_url=f"http://{host}:8470",
        heartbeat_interval_s=0.05,
        scan_on_start=False,
        watch=False,
        **kw,
    )


def test_two_hosts_register_heartbeat_and_own_their_directory_tiers(
    tmp_path: Path, pg_url: str
) -> None:
    a = _settings(tmp_path / "a", "host-a", catalog_url=pg_url)
    b = _settings(tmp_path / "b", "host-b", catalog_url=pg_url)
    with Engine(a.engine_config()) as ea, Engine(b.engine_config()) as eb:
        fa = put(ea, "m/a.bin", payload(1000, 1))
        fb = put(eb, "m/b.bin", payload(3000, 2), tier="ssd")
        hosts = Hosts(ea.catalog.db)
        first = hosts.get("host-b")
        assert first is not None and first.address == "http://host-b:8470"
        wait_for(
            lambda: hosts.get("host-b").last_heartbeat > first.last_heartbeat,  # type: ignore[union-attr]
            what="a heartbeat",
        )
        view = {h.host_id: h for h in fleet_hosts(Hosts(eb.catalog.db), timeout_s=30)}
        assert set(view) == {"host-a", "host-b"}
        assert {h.state for h in view.values()} == {"up"}
        use = {h: {t.name: (t.files, t.bytes) for t in v.tiers} for h, v in view.items()}
        assert use["host-a"] == {"nvme": (1, 1000), "ssd": (0, 0), "hdd": (0, 0)}
        assert use["host-b"] == {"nvme": (0, 0), "ssd": (1, 3000), "hdd": (0, 0)}
        [la, lb] = locate(
            hosts, Copies(ea.catalog.db), [ea.get(fa.id), ea.get(fb.id)], timeout_s=30
        )
        assert [(p.host_id, p.kind, p.location, p.rank) for p in la.places] == [
            ("host-a", "tier", "nvme", 0)
        ]
        assert [(p.host_id, p.location) for p in lb.places] == [("host-b", "ssd")]
        # Host B's planner sees only its own files: host A's are on disks B cannot reach.
        assert [r.id for r in eb.catalog.actionable()] == [fb.id]
    # Stopped hosts keep their rows; past the timeout they are down, records as they were.
    with Engine(a.engine_config()) as ea:
        later = time.time() + 60
        view = {h.host_id: h for h in fleet_hosts(Hosts(ea.catalog.db), timeout_s=30, now=later)}
        assert view["host-b"].state == "down"
        assert ea.catalog.lookup("m/b.bin").host == "host-b"
        report = json.loads(Hosts(ea.catalog.db).get("host-a").report)  # type: ignore[union-attr]
        assert [t["name"] for t in report["tiers"]] == ["nvme", "ssd", "hdd"]


def test_one_host_on_sqlite_adopts_its_older_records(tmp_path: Path) -> None:
    s = _settings(tmp_path / "d", "solo")
    with Engine(s.engine_config()) as eng:
        rec = put(eng, "x.bin", payload(500, 3))
        assert rec.host == "solo"
    run_sql(s.catalog_url, "UPDATE files SET host = NULL")  # as before migration 0007
    with Engine(s.engine_config()) as eng:
        assert eng.catalog.lookup("x.bin").host == "solo"
        [h] = fleet_hosts(Hosts(eng.catalog.db), timeout_s=30)
        assert (h.host_id, h.state, h.tiers[0].files) == ("solo", "up", 1)
