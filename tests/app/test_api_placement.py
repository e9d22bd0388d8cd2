"""``GET /v1/files/{id}/placement`` over HTTP while a move is really in flight: a real uvicorn
server runs a manual move on its scheduler's worker, held at its copy step by the mover's test
hook, and the endpoint names the move (its intent id) as what keeps the file where it is."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from tests.conftest import LiveServer, wait_for
from tests.helpers import engine_settings, payload

ADMIN, DATA = "admin-secret", "data-secret"


def test_placement_reports_the_move_in_flight(tmp_path: Path) -> None:
    settings = engine_settings(tmp_path / "data", admin_token=ADMIN, data_token=DATA)
    with LiveServer(settings) as srv, srv.client(ADMIN) as admin, srv.client(DATA) as data:
        engine = srv.server.config.app.state.engine
        body = payload(256 << 10)
        r = admin.put(
            "/v1/files/content", params={"path": "m/held.bin", "tier": "nvme"}, content=body
        )
        assert r.status_code == 201, r.text
        fid = r.json()["id"]

        copying, release = threading.Event(), threading.Event()

        def hold(step: str) -> None:
            if step == "copying":
                copying.set()
                release.wait(20)

        engine.mover.hook = hold
        try:
            r = admin.post("/v1/migrations", json={"file_id": fid, "to_tier": "ssd"})
            assert r.status_code == 202, r.text
            [started] = r.json()["migrations"]
            assert copying.wait(20), "the move never reached its copy"

            r = data.get(f"/v1/files/{fid}/placement")
            assert r.status_code == 200, r.text
            held: dict[str, Any] = r.json()
            assert (held["tier"], held["action"], held["move"]) == ("nvme", "stay", None)
            [reason] = held["reasons"]
            assert reason["code"] == "in_flight"
            assert reason["data"]["intent_id"] == started["id"]
            assert str(started["id"]) in reason["message"]
            in_flight = data.get("/v1/migrations", params={"state": "in_flight"}).json()["items"]
            assert [m["id"] for m in in_flight] == [started["id"]]
        finally:
            release.set()
            engine.mover.hook = None

        def finished() -> bool:
            [m] = data.get("/v1/migrations", params={"file_id": fid}).json()["items"]
            return bool(m["state"] == "done")

        wait_for(finished, what="the move to finish")
        after = data.get(f"/v1/files/{fid}/placement").json()
        assert after["tier"] == "ssd"
        assert "in_flight" not in [x["code"] for x in after["reasons"]]
        assert data.get(f"/v1/files/{fid}/content").content == body
