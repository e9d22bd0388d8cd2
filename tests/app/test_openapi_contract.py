"""The OpenAPI document is an exact contract (issue 14): schemathesis generates requests from it
and sends them to a real uvicorn server on loopback (real temp tiers, an Alembic-built SQLite
catalog), with the admin token and with the data token.

- ``test_every_operation``: each operation alone, in schemathesis' examples, coverage (boundary
  values, missing and unexpected parts, methods the path does not take) and fuzzing phases, with
  valid and invalid data;
- ``test_linked_sequences``: stateful sequences that follow the document's links: an upload's
  file id to reads, loads and pins; a load's buffer id to renew and release; a prefetch's job id
  to the job.

Every response must be no server error, with a status code, content type, headers and body that
the document declares for its operation; a method the path does not take must be a 405 whose
``Allow`` lists exactly the documented methods. Loads go to ``cpu`` (shared memory); the server
frees every lease, and stops every thread it started, when it stops at the end of the module.

A few examples per operation by default; many more with ``--runslow``.
"""

from __future__ import annotations

import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis
import pytest

# The test extra brings schemathesis; a machine without it (the GPU machine) skips, saying so.
schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed")
from hypothesis import strategies as st
from hypothesis.errors import FlakyStrategyDefinition
from hypothesis.stateful import Bundle, initialize
from schemathesis.checks import not_a_server_error
from schemathesis.generation.stateful.state_machine import StepInput, StepOutput
from schemathesis.specs.openapi.checks import (
    allow_header_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from app.api.responses import MAX_ID
from app.main import create_app
from app.settings import Settings
from tests.conftest import LiveServer
from tests.helpers import engine_settings

ADMIN, DATA = "admin-secret", "data-secret"
TOKENS = {"admin": ADMIN, "data": DATA}

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    unsupported_method,
    allow_header_conformance,
]


def _settings(root: Path) -> Settings:
    return engine_settings(root, admin_token=ADMIN, data_token=DATA)


# schemathesis' pytest integration makes one test per operation from a schema it has when the
# module is collected. (Its loader from a fixture, ``schemathesis.pytest.from_fixture``, fails
# on pytest 9.2: it sets ``Function._nodeid``, which pytest no longer has.) The document of an
# app built with the same settings is that schema: it names no tier root, so it does not depend
# on where the tiers are, and the server below checks that it serves exactly this document.
# Building the app does no I/O; its engine starts only in the lifespan.
DOCUMENT = create_app(_settings(Path(tempfile.gettempdir()) / "tierd-contract-unused")).openapi()
schema = schemathesis.openapi.from_dict(DOCUMENT)
# The same document for sequences: they follow its links, and only those (no links inferred).
linked = schemathesis.openapi.from_dict(
    DOCUMENT,
    config=schemathesis.Config.from_dict(
        {
            "phases": {
                "stateful": {"inference": {"algorithms": []}, "generation": {"mode": "positive"}}
            }
        }
    ),
)
_UPLOAD = linked["/v1/files/content"]["PUT"]
_TIERS = st.sampled_from([t.name for t in _settings(Path("unused")).tiers])


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    """The server serves the whole module, and threads its engine and loader start on demand
    outlive a test by design: ``server`` checks, once, that none outlives the server."""
    yield


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    before = set(threading.enumerate())
    with LiveServer(_settings(tmp_path_factory.mktemp("contract") / "data")) as srv:
        served = srv.client().get("/openapi.json")
        assert served.status_code == 200 and served.json() == DOCUMENT
        yield srv
    deadline = time.monotonic() + 5
    while True:
        leaked = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert not leaked, f"the server left threads running: {leaked}"


def test_the_document_links_and_bounds() -> None:
    """What the completed document says beyond FastAPI's (see ``app.api.openapi``)."""
    paths, schemas = DOCUMENT["paths"], DOCUMENT["components"]["schemas"]
    links = paths["/v1/files/content"]["put"]["responses"]["201"]["links"]
    assert {"GetFile", "ReadContent", "Load", "Pin", "Unpin", "Prefetch"} <= set(links)
    assert links["Load"]["requestBody"] == {"file_id": "$response.body#/id", "device": "cpu"}
    for source, name in [("/v1/load", "RenewBuffer"), ("/v1/load", "ReleaseBuffer")]:
        link = paths[source]["post"]["responses"]["200"]["links"][name]
        assert link["parameters"] == {"buffer_id": "$response.body#/buffer_id"}
    job = paths["/v1/prefetch"]["post"]["responses"]["202"]["links"]["GetJob"]
    assert job["parameters"] == {"job_id": "$response.body#/id"}
    # Every 422 is the error body (FastAPI's own validation error schema is gone).
    assert "HTTPValidationError" not in str(DOCUMENT)
    # Integer bounds are exact: FastAPI's float rendering of 2**63 - 1 is one past it.
    file_id = schemas["LoadRequest"]["properties"]["file_id"]["anyOf"][0]
    assert file_id["maximum"] == MAX_ID and isinstance(file_id["maximum"], int)
    # Bounds the settings set, and every response's request id.
    buffers = _settings(Path("unused")).buffers
    ttl = schemas["LoadRequest"]["properties"]["ttl_s"]["anyOf"][0]
    assert ttl["maximum"] == buffers.max_ttl_s
    indices = schemas["GatherRequest"]["properties"]["indices"]["anyOf"][0]
    assert indices["maxItems"] == buffers.max_gather_indices
    assert schemas["MoveRequest"]["properties"]["to_tier"]["anyOf"][0]["enum"] == [
        "nvme",
        "ssd",
        "hdd",
    ]
    assert DOCUMENT["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for ops in paths.values():
        for op in ops.values():
            for response in op["responses"].values():
                assert response["headers"]["X-Request-ID"]["required"] is True


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _call_and_validate(case: schemathesis.Case, server: LiveServer, token: str) -> None:
    # The token replaces whatever Authorization the case was generated with; a case generated
    # to go without one (the bearer scheme is declared) still goes without, and must get a 401.
    case.call_and_validate(base_url=server.url, headers=_auth(token), checks=CHECKS)


# Suite time: the data token's pass over every operation runs with --runslow (the linked
# sequences below, and tests/app/test_auth.py, take the data token through the API in CI).
@pytest.mark.parametrize("role", ["admin", pytest.param("data", marks=pytest.mark.slow)])
@schema.parametrize()
@hypothesis.settings(max_examples=3, deadline=None)  # suite time; --runslow's run goes to 100
def test_every_operation(case: schemathesis.Case, server: LiveServer, role: str) -> None:
    _call_and_validate(case, server, TOKENS[role])


@pytest.mark.slow
@pytest.mark.parametrize("role", sorted(TOKENS))
@schema.parametrize()
@hypothesis.settings(max_examples=100, deadline=None)
def test_every_operation_at_length(case: schemathesis.Case, server: LiveServer, role: str) -> None:
    _call_and_validate(case, server, TOKENS[role])


@pytest.mark.parametrize("role", sorted(TOKENS))
def test_linked_sequences(server: LiveServer, role: str, request: pytest.FixtureRequest) -> None:
    token = TOKENS[role]

    class Sequences(linked.as_state_machine()):  # type: ignore[misc]
        @initialize(target=Bundle("catch_all"), data=st.binary(max_size=4096), tier=_TIERS)
        def upload(self, data: bytes, tier: str) -> StepOutput:
            """Each scenario starts with a file. schemathesis starts chains only at POSTs and at
            GETs without path parameters, and tierd creates files with a PUT, so without this
            the links of an upload would never be followed. The output is routed to the
            bundles of the upload's links like any step's."""
            case = _UPLOAD.Case(
                query={"path": f"linked/{uuid.uuid4().hex}.bin", "tier": tier},
                body=data,
                media_type="application/octet-stream",
            )
            step = StepInput.initial(case)
            # What schemathesis' own steps record (in ``transition``): the case, and the upload
            # as a source whose derived calls are counted (and capped per scenario).
            self.recorder.record_case(case=case)
            self.control.record_step(step, self.recorder)
            output: StepOutput = self.step(step)
            assert output.response.status_code == 201, output.response.text
            return output

        def get_call_kwargs(self, case: schemathesis.Case) -> dict[str, Any]:
            return {"base_url": server.url, "headers": _auth(token)}

        def validate_response(
            self, response: Any, case: schemathesis.Case, additional_checks: Any = None, **kw: Any
        ) -> None:
            try:
                case.validate_response(
                    response, checks=CHECKS, transport_kwargs=kw or None, recorder=self.recorder
                )
            except Exception as exc:
                failures.append(exc)
                raise

        def teardown(self) -> None:
            scenarios.append(None)
            super().teardown()

    failures: list[Exception] = []
    scenarios: list[None] = []
    slow = request.config.getoption("--runslow")
    wanted = 100 if slow else 10
    for _ in range(10):
        try:
            Sequences.run(
                settings=hypothesis.settings(
                    max_examples=wanted - len(scenarios),
                    stateful_step_count=25 if slow else 15,
                    deadline=None,
                    phases=[hypothesis.Phase.generate],
                    suppress_health_check=list(hypothesis.HealthCheck),
                    database=None,
                )
            )
            return
        except FlakyStrategyDefinition:
            # Hypothesis chooses each step from the bundles and preconditions that earlier
            # responses filled, and the server's state carries over from scenario to scenario
            # (files, leases, jobs, moves), so two scenarios it began alike can diverge: then it
            # cannot go on exploring, and says so. That is no failure of a check (those are
            # raised, not replayed away, as schemathesis' own runner also judges): run the
            # scenarios left, in a new run.
            if failures:
                raise failures[0] from None
            if len(scenarios) >= wanted:
                return
    pytest.fail(f"only {len(scenarios)} of {wanted} scenarios ran: Hypothesis kept diverging")
