"""The compose smoke test's checks against a running tierd (see .ci/compose-smoke).

``first``: ready; 401 without a token; an upload with its checksum; read back and compared;
a load into cpu, released. ``again`` (after a restart of the container): the file is still
there and reads back the same. Exits non-zero, saying what failed."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import httpx

from tiering.checksum import Hasher

STATE = Path("/tmp/tierd-compose-smoke.json")
PATH = "smoke/weights.bin"


def _ready(http: httpx.Client) -> None:
    deadline = time.monotonic() + 90
    while True:
        try:
            r = http.get("/readyz")
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("tierd did not become ready in 90 s")
        time.sleep(0.5)


def _sum(data: bytes) -> str:
    h = Hasher()
    h.update(data)
    return h.value()


def main(url: str, token: str, phase: str) -> None:
    with httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60
    ) as http:
        _ready(http)
        if phase == "first":
            # The tokens reached the container: without one, 401.
            r = httpx.get(f"{url}/v1/files", timeout=10)
            if r.status_code != 401:
                raise SystemExit(f"without a token: {r.status_code}, not 401")
            data = os.urandom(8 << 20)
            r = http.put(
                "/v1/files/content", params={"path": PATH, "checksum": _sum(data)}, content=data
            )
            if r.status_code != 201:
                raise SystemExit(f"upload: {r.status_code} {r.text}")
            fid = r.json()["id"]
            STATE.write_text(json.dumps({"id": fid, "checksum": _sum(data)}))
            if _sum(http.get(f"/v1/files/{fid}/content").content) != _sum(data):
                raise SystemExit("the bytes read back differ from those uploaded")
            r = http.post("/v1/load", json={"file_id": fid, "device": "cpu"})
            if r.status_code != 200 or r.json()["nbytes"] != len(data):
                raise SystemExit(f"load into cpu: {r.status_code} {r.text}")
            http.delete(f"/v1/buffers/{r.json()['buffer_id']}").raise_for_status()
        else:
            state = json.loads(STATE.read_text())
            r = http.get("/v1/files/lookup", params={"path": PATH})
            if r.status_code != 200 or r.json()["id"] != state["id"]:
                raise SystemExit(f"after the restart: {r.status_code} {r.text}")
            if _sum(http.get(f"/v1/files/{state['id']}/content").content) != state["checksum"]:
                raise SystemExit("after the restart the bytes differ")


if __name__ == "__main__":
    main(*sys.argv[1:4])
