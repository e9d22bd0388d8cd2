"""While tierd serves, its GIL's switch interval is :data:`app.main.SWITCH_INTERVAL_S`: the
event loop holds the GIL most of a busy server's time, and a move's steps and a request's
hop to the thread pool each wait up to the interval to take it back."""

from __future__ import annotations

import sys

from fastapi.testclient import TestClient

from app.main import SWITCH_INTERVAL_S, create_app
from app.settings import Settings


def test_the_server_switches_the_gil_more_often_while_it_serves(settings: Settings) -> None:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.004)  # not the server's: another in-process server may have set it
    try:
        app = create_app(settings)
        assert sys.getswitchinterval() == 0.004  # building the app changes nothing
        with TestClient(app, base_url="http://127.0.0.1") as c:
            assert c.get("/readyz").status_code == 200
            assert sys.getswitchinterval() == SWITCH_INTERVAL_S
    finally:
        sys.setswitchinterval(before)
