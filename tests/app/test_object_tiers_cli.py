"""An object-store tier from the operator's side: configured in tierd.toml, refused at start
with one clear line naming the bucket and the reason, shown by ``tierd tiers`` and
``GET /v1/tiers`` with its kind and unknown capacity, adopted by ``tierd scan``. A real S3
server (moto) on loopback; credentials only in the environment, never printed."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from app.cli import cli
from tests.s3 import REGION, SECRET_KEY

runner = CliRunner()


def run(*args: str, stdout: bool = False) -> tuple[int, str]:
    result = runner.invoke(cli, list(args), env={"COLUMNS": "250"})  # rich: no truncation
    # ``stdout``: the command's output alone (log lines, on stderr, are left out).
    return result.exit_code, " ".join((result.stdout if stdout else result.output).split())


def _config(tmp_path: Path, url: str, endpoint: str) -> Path:
    cfg = tmp_path / "tierd.toml"
    cfg.write_text(
        f"""
data_dir = "{tmp_path / "data"}"
[[tiers]]
name = "nvme"
path = "{tmp_path / "nvme"}"
[[tiers]]
name = "s3"
url = "{url}"
endpoint_url = "{endpoint}"
region = "{REGION}"
"""
    )
    return cfg


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once the socket is closed


def test_serve_refuses_a_missing_bucket_naming_it(
    tmp_path: Path, moto_endpoint: str, s3_env: Any
) -> None:
    cfg = _config(tmp_path, "s3://no-such-bucket-here/models", moto_endpoint)
    code, out = run("serve", "--config", str(cfg))
    assert code == 1, out
    assert "no-such-bucket-here" in out and "no such bucket" in out.lower()
    assert SECRET_KEY not in out


def test_serve_refuses_an_unreachable_endpoint(tmp_path: Path, s3_env: Any) -> None:
    cfg = _config(tmp_path, "s3://models-bucket/x", f"http://127.0.0.1:{_closed_port()}")
    code, out = run("serve", "--config", str(cfg))
    assert code == 1, out
    assert "models-bucket" in out and "unreachable" in out.lower()
    assert SECRET_KEY not in out


def test_tiers_and_scan_show_the_bucket(
    tmp_path: Path, moto_endpoint: str, s3_env: Any, s3_client: Any, s3_bucket: str
) -> None:
    for i in range(3):
        s3_client.put_object(Bucket=s3_bucket, Key=f"models/m/shard-{i}.bin", Body=b"w" * 10)
    cfg = _config(tmp_path, f"s3://{s3_bucket}/models", moto_endpoint)
    code, out = run("scan", "--config", str(cfg), "--json", stdout=True)
    assert code == 0, out
    report = json.loads(out)
    assert sorted(report["adopted"]) == [f"m/shard-{i}.bin" for i in range(3)]
    code, out = run("tiers", "--config", str(cfg), "--json", stdout=True)
    assert code == 0, out
    tiers = json.loads(out)
    s3 = {t["name"]: t for t in tiers}["s3"]
    assert s3["kind"] == "object" and s3["path"].startswith(f"s3://{s3_bucket}/models")
    assert s3["capacity_bytes"] is None and s3["free_bytes"] is None
    assert s3["files"] == 3 and s3["file_bytes"] == 30
    code, out = run("tiers", "--config", str(cfg))
    # At 80 columns (rich's width when COLUMNS was set at import) the table shortens long
    # cells ("unkno…"); the JSON above carries the unknown capacity whatever the width.
    assert code == 0 and "object" in out and "s3://" in out
    assert SECRET_KEY not in out
