"""tierd policy show|set, plan, migrate, migrations, pin|unpin through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from app.cli import cli
from tests.helpers import engine_settings, payload, put
from tiering.engine import Engine

runner = CliRunner()


def run(data: Path, *args: str, code: int = 0, stdin: str | None = None) -> str:
    r = runner.invoke(cli, [*args, "--data-dir", str(data)], input=stdin)
    assert r.exit_code == code, (args, r.exit_code, r.output, r.exception)
    return r.output


def test_policy_plan_migrate_pin(tmp_path: Path) -> None:
    data = tmp_path / "data"
    settings = engine_settings(data)
    with Engine(settings.engine_config()) as eng:
        put(eng, "m/w.bin", payload(1 << 20))
        put(eng, "m/x.bin", b"x" * 10)
    shown = json.loads(run(data, "policy", "show", "--json"))
    assert shown["version"] == 0 and shown["policy"]["tiers"]["ssd"]["min_heat"] == 10
    assert "policy version 0" in run(data, "policy", "show")

    # set: from a file, from stdin (the show output is accepted as it is), and a bad one.
    doc = shown["policy"] | {"min_age_s": 0}
    (tmp_path / "p.json").write_text(json.dumps(doc))
    assert (
        json.loads(run(data, "policy", "set", str(tmp_path / "p.json"), "--json"))["version"] == 1
    )
    shown["policy"]["min_age_s"] = 0
    shown["policy"]["hysteresis"] = 0.3
    assert "policy version 2" in run(data, "policy", "set", "-", stdin=json.dumps(shown))
    bad = run(data, "policy", "set", "-", stdin=json.dumps(doc | {"hysteresis": 2}), code=1)
    assert "hysteresis" in bad
    assert "cannot read a JSON policy" in run(data, "policy", "set", "-", stdin="{", code=2)

    moves = json.loads(run(data, "plan", "--json"))
    assert {(m["path"], m["to_tier"]) for m in moves} == {("m/w.bin", "hdd"), ("m/x.bin", "hdd")}
    assert "demote nvme → hdd" in run(data, "plan")

    out = run(data, "migrate", "m/w.bin", "--to", "ssd")
    assert "m/w.bin: nvme → ssd done" in out
    assert "needs both" in run(data, "migrate", "m/w.bin", code=2)
    assert "already on tier ssd" in run(data, "migrate", "m/w.bin", "--to", "ssd", code=1)

    pinned = json.loads(run(data, "pin", "m/x.bin", "--json"))
    assert pinned["pinned_tier"] == "nvme"
    ran = json.loads(run(data, "migrate", "--json"))  # the plan: only the unpinned file moves
    assert [(r["path"], r["to_tier"], r["state"]) for r in ran] == [("m/w.bin", "hdd", "done")]
    assert "unpinned" in run(data, "unpin", "m/x.bin")
    history = json.loads(run(data, "migrations", "--json"))
    assert [h["to_tier"] for h in history] == ["hdd", "ssd"]
    assert "nothing to move" not in run(data, "plan")


def test_changes_refused_while_a_server_holds_the_catalog(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with Engine(engine_settings(data).engine_config()) as eng:
        put(eng, "a", b"a")
        out = run(data, "migrate", "a", "--to", "hdd", code=1)
        assert "POST /v1/migrations" in out
        assert "PUT /v1/policy" in run(data, "policy", "set", "-", stdin="{}", code=1)
        # Reads still work beside it.
        assert json.loads(run(data, "plan", "--json")) == []
        assert eng.get(1).tier == "nvme"
