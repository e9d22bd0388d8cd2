"""A web page in a real browser (headless Chromium) against a tierd without tokens (issue 40,
RELIABILITY.md row 34): a page of another site sends what a page can send without asking (a
body-less ``fetch()`` POST, a form's POST, a beacon, an ``<img>``) and reads nothing through a
name re-pointed at loopback (DNS rebinding); tierd's own page, in the same browser, still works.
The headers are the browser's own, not a test's idea of them. Skips where there is no Chromium.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import LiveServer, make_settings
from tests.helpers import chromium, chromium_options

ATTACKER = "attacker.test"  # resolved to 127.0.0.1 by the browser alone (--host-resolver-rules)

PAGE = """<!doctype html>
<iframe name="sink"></iframe>
<form id="scan" method="post" target="sink" action="{tierd}/v1/scan"></form>
<script>
(async () => {{
  const tierd = "{tierd}", out = {{}};
  // A body-less POST, which a page sends without asking (no CORS preflight).
  await fetch(tierd + "/v1/files/{fid}/pin", {{method: "POST", mode: "no-cors"}})
    .then(() => out.pin = "sent", e => out.pin = "error " + e);
  // A beacon: a POST the browser sends even as the page goes away.
  out.beacon = navigator.sendBeacon(tierd + "/v1/stats/reset");
  // A read of the content as an image: the browser fetches it, the page never sees it.
  await new Promise(done => {{
    const img = new Image();
    img.onload = img.onerror = done;
    img.src = tierd + "/v1/files/{fid}/content";
  }});
  // A read the page would see if tierd allowed it (it sends no CORS headers either way).
  await fetch(tierd + "/v1/files").then(r => r.text()).then(
    t => out.read = t, e => out.read = "error " + e);
  // A form's POST (into the iframe, so that the page stays).
  await new Promise(done => {{
    document.querySelector("iframe").onload = done; document.getElementById("scan").submit();
  }});
  document.title = "done " + JSON.stringify(out);
}})();
</script>
"""


# A page of the attacker's that sends its own window to tierd (no user gesture), and a link the
# user clicks.
LINKS = """<!doctype html>
<a id="link" href="{tierd}/healthz">tierd</a>
<script>
if (location.hash === "#send") location.href = "{tierd}/healthz";
</script>
"""


@pytest.fixture
def browser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    webdriver, chrome, chromedriver = chromium()
    from selenium.webdriver.chrome.service import Service

    opts = chromium_options(
        webdriver,
        chrome,
        tmp_path / "chrome-profile",
        f"--host-resolver-rules=MAP {ATTACKER} 127.0.0.1",
    )
    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager looks for no driver online
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=chromedriver))
    try:
        yield driver
    finally:
        driver.quit()


class _Site:
    """The attacker's site: one page, on a port of its own."""

    def __init__(self, pages: dict[str, str]) -> None:
        bodies = {path: page.encode() for path, page in pages.items()}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = bodies.get(self.path.split("?")[0], b"")
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="attacker-site")
        self.url = f"http://{ATTACKER}:{self.server.server_address[1]}/"

    def __enter__(self) -> _Site:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def _seen(srv: LiveServer, http: httpx.Client, fid: int) -> tuple[Any, ...]:
    """What the page would change: the file's pin and access count, whether a planted file
    was adopted (a scan), the load counters (a stats reset)."""
    srv.server.config.app.state.engine.access.flush()
    rec = http.get(f"/v1/files/{fid}").json()
    planted = http.get("/v1/files/lookup", params={"path": "planted.bin"}).status_code
    loads = http.get("/v1/stats").json()["operations_completed"]
    return rec["pinned_tier"], rec["access_count"], planted, loads


def test_a_page_of_another_site_changes_nothing_and_reads_nothing(
    browser: Any, host_network: None, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    settings = make_settings(tmp_path / "data", watch=False)
    with LiveServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        r = http.put("/v1/files/content", params={"path": "m/w.bin"}, content=b"weights")
        fid = r.json()["id"]
        lease = http.post("/v1/load", json={"file_id": fid, "device": "cpu"}).json()
        assert http.delete(f"/v1/buffers/{lease['buffer_id']}").status_code == 200
        (settings.data_dir / "nvme" / "planted.bin").write_bytes(b"for a scan to adopt")
        before = _seen(srv, http, fid)
        assert before[2] == 404 and before[3] == 1, before

        pages = {"/": PAGE.format(tierd=srv.url, fid=fid), "/links": LINKS.format(tierd=srv.url)}
        with _Site(pages) as site:
            browser.get(site.url)
            WebDriverWait(browser, 20).until(lambda d: d.title.startswith("done"))
            out = browser.title
            assert '"beacon":true' in out and "w.bin" not in out, out  # sent, nothing read
            assert _seen(srv, http, fid) == before
            # The page sends its window to tierd by itself: refused. The user clicks a link
            # to tierd: it opens.
            browser.get(site.url + "links#send")
            WebDriverWait(browser, 20).until(lambda d: d.current_url.startswith(srv.url))
            assert "cross_site_request" in browser.find_element(By.TAG_NAME, "body").text
            browser.get(site.url + "links")
            browser.find_element(By.ID, "link").click()
            WebDriverWait(browser, 20).until(lambda d: d.current_url.startswith(srv.url))
            assert "ok" in browser.find_element(By.TAG_NAME, "body").text

        # DNS rebinding: the attacker's name, now 127.0.0.1, on tierd's port. The page is the
        # attacker's origin, so it would read this answer; it is a 421.
        browser.get(f"http://{ATTACKER}:{srv.settings.port}/v1/files")
        text = browser.find_element(By.TAG_NAME, "body").text
        assert "unknown_host" in text and "w.bin" not in text, text

        # tierd's own page in the same browser: its POSTs (with the browser's Origin and
        # Sec-Fetch-Site) pass.
        browser.get(f"{srv.url}/healthz")
        status = browser.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            f"fetch('/v1/files/{fid}/pin', {{method: 'POST'}}).then(r => done(r.status));"
        )
        assert status == 200
        assert http.get(f"/v1/files/{fid}").json()["pinned_tier"] is not None
