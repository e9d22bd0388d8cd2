"""Fixtures for object-store tiers: a real S3-protocol server (moto) on loopback, a fresh
bucket per test, AWS credentials in the environment only while a test runs, object tiers,
and a fault-injecting proxy.

Bytes always cross HTTP: there are no in-process mocks of boto. Import the fixtures into a
``conftest.py`` (or list this module in the root conftest's ``pytest_plugins``).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.s3_faults import FaultProxy
from tiering.config import TierConfig

__all__ = [
    "ACCESS_KEY",
    "SECRET_KEY",
    "fault_proxy",
    "make_object_tier",
    "MotoIam",
    "moto_endpoint",
    "moto_iam",
    "moto_server",
    "object_tier",
    "s3_bucket",
    "s3_client",
    "s3_env",
]

ACCESS_KEY = "AKIATIERDTESTKEY0001"
SECRET_KEY = "tierd-test-secret-do-not-log-0123456789"
REGION = "us-east-1"
#: Parts this small keep multipart tests fast; moto is told to accept them.
SMALL_PART = 64 << 10


def raw_client(endpoint: str, **creds: str) -> Any:
    """A plain boto3 client (another writer, behind tierd's back). Close it after use."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=creds.get("key", ACCESS_KEY),
        aws_secret_access_key=creds.get("secret", SECRET_KEY),
    )


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str | None]:
    """``http://127.0.0.1:<port>`` of a moto server shared by the session, or None when moto
    is not installed. It never skips, so a fixture that may or may not use the server (one
    parametrised over backends) can request it up front: a session fixture first set up
    lazily, through ``request.getfixturevalue``, would start its threads inside a test, and
    the leak check would blame that test.
    """
    try:
        import moto.s3.models
        from moto.server import ThreadedMotoServer
    except ImportError:
        yield None
        return
    with pytest.MonkeyPatch.context() as mp:
        # S3 wants parts of at least 5 MiB; the tests use 64 KiB parts to stay fast.
        mp.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 1024)
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.stop()
            inner = getattr(server, "_server", None)
            if inner is not None:
                inner.server_close()


@pytest.fixture(scope="session")
def moto_endpoint(moto_server: str | None) -> str:
    """The moto server's URL; skips the test when moto[server] is not installed."""
    if moto_server is None:
        pytest.skip("moto[server] is not installed")
    return moto_server


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> dict[str, str]:
    """The test's credentials in the environment (the AWS chain's first link), and nothing of
    the developer's: no profile, no shared files, no instance metadata."""
    for var in (
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_ROLE_ARN",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    ):
        monkeypatch.delenv(var, raising=False)
    env = {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture(scope="session")
def s3_client(moto_endpoint: str) -> Iterator[Any]:
    """A plain boto3 client of the moto server, one per test process: making one builds a
    botocore session and its endpoint rules (50 ms of CPU), and clients are thread-safe."""
    client = raw_client(moto_endpoint)
    yield client
    client.close()


@pytest.fixture
def s3_bucket(s3_client: Any) -> str:
    """A new, empty bucket for this test."""
    name = f"tierd-{uuid.uuid4().hex[:16]}"
    s3_client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def make_object_tier(
    moto_endpoint: str, s3_bucket: str, s3_env: dict[str, str]
) -> Iterator[Callable[..., Any]]:
    """``make(name="s3", *, url=None, endpoint_url=None, rank=1, compression="off", **kwargs)``:
    an ObjectTier on the test's bucket (prefix ``pre``) with small parts, storing files as they
    are unless ``compression`` says otherwise (the tiers' own default, ``auto``, compresses:
    the server's tests run it); every tier made is closed after."""
    from tiering.tiers._object import ObjectTier

    made: list[ObjectTier] = []

    def make(
        name: str = "s3",
        *,
        url: str | None = None,
        endpoint_url: str | None = None,
        rank: int = 1,
        compression: str = "off",
        **kwargs: Any,
    ) -> ObjectTier:
        kwargs.setdefault("part_size", SMALL_PART)
        kwargs.setdefault("read_size", SMALL_PART)
        kwargs.setdefault("readahead_bytes", 4 * SMALL_PART)
        kwargs.setdefault("workers", 8)
        cfg = TierConfig(
            name,
            kind="object",
            url=url or f"s3://{s3_bucket}/pre",
            endpoint_url=endpoint_url or moto_endpoint,
            region=REGION,
            compression=compression,
        )
        tier = ObjectTier(cfg, rank, **kwargs)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


@pytest.fixture
def object_tier(make_object_tier: Callable[..., Any]) -> Any:
    tier = make_object_tier()
    tier.check()
    return tier


class MotoIam:
    """IAM users on the moto server, and a switch that makes it check signatures and policies
    (moto accepts any request until told otherwise; the switch is undone after the test)."""

    def __init__(self, endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.endpoint = endpoint
        self._mp = monkeypatch

    def user(self, *actions: str) -> tuple[str, str]:
        """A new user allowed ``actions`` (e.g. ``"s3:*"``): its (access key, secret)."""
        import boto3

        name = f"tierd-{uuid.uuid4().hex[:12]}"
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": list(actions), "Resource": "*"}],
        }
        iam = boto3.client(
            "iam",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
        )
        try:
            iam.create_user(UserName=name)
            iam.put_user_policy(UserName=name, PolicyName="p", PolicyDocument=json.dumps(policy))
            key = iam.create_access_key(UserName=name)["AccessKey"]
        finally:
            iam.close()
        return key["AccessKeyId"], key["SecretAccessKey"]

    def enforce(self) -> None:
        """From now until the test ends, every request must be signed by a known key and be
        allowed by that user's policy."""
        import moto.settings
        from moto.core.authorization import ActionAuthenticatorMixin

        self._mp.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
        self._mp.setattr(ActionAuthenticatorMixin, "request_count", 0)


@pytest.fixture
def moto_iam(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> MotoIam:
    return MotoIam(moto_endpoint, monkeypatch)


@pytest.fixture
def fault_proxy(moto_endpoint: str) -> Iterator[FaultProxy]:
    """A :class:`FaultProxy` in front of the moto server; stopped (threads joined) after."""
    with FaultProxy(moto_endpoint) as proxy:
        yield proxy
