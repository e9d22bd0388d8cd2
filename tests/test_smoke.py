def test_live_server_roundtrip(live_server):
    with live_server.client() as c:
        r = c.put("/v1/files/content", params={"path": "m/w.bin"}, content=b"abc")
        assert r.status_code == 201
        assert c.get(f"/v1/files/{r.json()['id']}/content").content == b"abc"
