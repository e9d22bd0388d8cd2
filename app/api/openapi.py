"""The OpenAPI document: FastAPI's, completed with what the routes alone cannot say.

:func:`install_openapi` replaces ``app.openapi`` (FastAPI's documented way to extend the
document). The document is built once, from FastAPI's, and then:

- **links** between operations (:data:`LINKS`): an upload's file id to the reads, loads and pins
  of that file, a load's buffer id to renew and release, a prefetch's job id to the job. Client
  generators and tools that follow them (schemathesis' stateful tests) chain calls with them;
- **every 422 is the error body**: FastAPI declares its own ``HTTPValidationError`` 422 on every
  route with parameters, but ``app.errors`` answers every validation error with ``ErrorBody``;
- **bounds that come from the settings**: the longest lease (``buffers.max_ttl_s``), the longest
  index list of a gather and the most items of a batch, and the names of the tiers;
- **exact integer bounds**: FastAPI round-trips the document through its pydantic model of
  OpenAPI, whose ``minimum``/``maximum`` are floats, so ``le=2**63 - 1`` became
  ``9.223372036854776e18``, which is 2**63, one past SQLite's largest id;
- ``X-Request-ID`` on every response, and the bearer scheme on every route that takes a token;
- **415 on every route with a JSON body, and every POST**: a body not sent as
  ``application/json`` is refused, and a POST sent as a form, body or none
  (``app.api.deps.json_bodies`` says why), whichever route it was sent to;
- **421 and 403 of a tierd without tokens** (``app.browsers``): a foreign ``Host``, and a
  request a page of another site made.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI

from app.api.responses import MAX_ID, NOT_JSON
from app.logs import REQUEST_ID_HEADER
from app.settings import Settings

__all__ = ["LINKS", "Link", "complete_openapi", "install_openapi"]

Doc = dict[str, Any]

_FILE_ID = "$response.body#/id"
_BUFFER_ID = "$response.body#/buffer_id"
_JOB_ID = "$response.body#/id"
_PATH = "$response.body#/path"
# The extension schemathesis reads (other tools ignore it): send the link's body as it is,
# instead of merging it into a generated one (which could name the file twice, by id and path).
_AS_IS = {"x-schemathesis": {"merge_body": False}}


@dataclass(frozen=True)
class Link:
    """An OpenAPI link from a response of ``source`` to the operation ``target``."""

    name: str
    source: tuple[str, str]  # method, path
    statuses: tuple[str, ...]
    target: tuple[str, str]
    parameters: dict[str, str] = field(default_factory=dict)
    body: Any = None
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _file_links(
    source: tuple[str, str], statuses: tuple[str, ...], *, skip: tuple[str, ...] = ()
) -> list[Link]:
    """What one can do with a file whose record a response returns."""
    by_id = {"file_id": _FILE_ID}
    links = [
        Link("GetFile", source, statuses, ("get", "/v1/files/{file_id}"), by_id),
        Link("LookupFile", source, statuses, ("get", "/v1/files/lookup"), {"path": _PATH}),
        Link("ReadContent", source, statuses, ("get", "/v1/files/{file_id}/content"), by_id),
        Link("ExplainPlacement", source, statuses, ("get", "/v1/files/{file_id}/placement"), by_id),
        Link("Pin", source, statuses, ("post", "/v1/files/{file_id}/pin"), by_id),
        Link("Unpin", source, statuses, ("delete", "/v1/files/{file_id}/pin"), by_id),
        Link(
            "Load",
            source,
            statuses,
            ("post", "/v1/load"),
            body={"file_id": _FILE_ID, "device": "cpu"},
            description="The whole file into a shared-memory buffer",
            extra=_AS_IS,
        ),
        Link(
            "LoadBatch",
            source,
            statuses,
            ("post", "/v1/load/batch"),
            body={"items": [{"file_id": _FILE_ID}], "device": "cpu"},
            extra=_AS_IS,
        ),
        Link(
            "Gather",
            source,
            statuses,
            ("post", "/v1/vectors/gather"),
            body={"file_id": _FILE_ID, "dim": 1, "dtype": "uint8", "start": 0, "count": 1},
            description="The file's first byte, as one row of one uint8",
            extra=_AS_IS,
        ),
        Link(
            "Prefetch",
            source,
            statuses,
            ("post", "/v1/prefetch"),
            body={"file_ids": [_FILE_ID], "target": "page_cache"},
            extra=_AS_IS,
        ),
        Link(
            "Migrate",
            source,
            statuses,
            ("post", "/v1/migrations"),
            body={"file_id": _FILE_ID},
            description="Move the file (to the tier the request names)",
        ),
        Link("ListMigrations", source, statuses, ("get", "/v1/migrations"), by_id),
        Link("DeleteFile", source, statuses, ("delete", "/v1/files/{file_id}"), by_id),
    ]
    return [link for link in links if link.name not in skip]


def _lease_links(source: tuple[str, str], pointer: str) -> list[Link]:
    """What one can do with a buffer lease a response returns (at ``pointer``)."""
    by_id = {"buffer_id": pointer}
    ok = ("200",)
    return [
        Link("GetBuffer", source, ok, ("get", "/v1/buffers/{buffer_id}"), by_id),
        Link("RenewBuffer", source, ok, ("post", "/v1/buffers/{buffer_id}/renew"), by_id),
        Link("ReleaseBuffer", source, ok, ("delete", "/v1/buffers/{buffer_id}"), by_id),
    ]


def _model_links(source: tuple[str, str]) -> list[Link]:
    """What one can do with a model whose name a response returns."""
    by_name = {"name": "$response.body#/name"}
    ok = ("200",)
    return [
        Link("LoadModel", source, ok, ("post", "/v1/models/load"), by_name, {"device": "cpu"}),
        Link(
            "PrefetchModel",
            source,
            ok,
            _MODEL_PREFETCH,
            by_name,
            {"target": "page_cache"},
            extra=_AS_IS,
        ),
        Link("PinModel", source, ok, ("post", "/v1/models/pin"), by_name),
        Link("UnpinModel", source, ok, ("delete", "/v1/models/pin"), by_name),
    ]


_MODEL_PREFETCH = ("post", "/v1/models/prefetch")
_PIN = ("post", "/v1/files/{file_id}/pin")
_UNPIN = ("delete", "/v1/files/{file_id}/pin")
_RENEW = ("post", "/v1/buffers/{buffer_id}/renew")
_RELEASE = ("delete", "/v1/buffers/{buffer_id}")
_FIRST_BUFFER = "$response.body#/buffers/0/buffer_id"

LINKS: list[Link] = [
    *_file_links(("put", "/v1/files/content"), ("200", "201")),
    *_file_links(("get", "/v1/files/lookup"), ("200",), skip=("LookupFile",)),
    Link("Unpin", _PIN, ("200",), _UNPIN, {"file_id": _FILE_ID}),
    Link("Pin", _UNPIN, ("200",), _PIN, {"file_id": _FILE_ID}),
    *_lease_links(("post", "/v1/load"), _BUFFER_ID),
    *_lease_links(("post", "/v1/vectors/gather"), _BUFFER_ID),
    *_lease_links(("post", "/v1/load/batch"), _FIRST_BUFFER),
    *_lease_links(("post", "/v1/load/safetensors"), _FIRST_BUFFER),
    Link("ReleaseBuffer", _RENEW, ("200",), _RELEASE, {"buffer_id": _BUFFER_ID}),
    Link(
        "GetJob",
        ("post", "/v1/prefetch"),
        ("202",),
        ("get", "/v1/jobs/{job_id}"),
        {"job_id": _JOB_ID},
    ),
    Link(
        "CancelJob",
        ("post", "/v1/prefetch"),
        ("202",),
        ("delete", "/v1/jobs/{job_id}"),
        {"job_id": _JOB_ID},
    ),
    *_lease_links(("post", "/v1/models/load"), _FIRST_BUFFER),
    *_model_links(("get", "/v1/models/lookup")),
    Link("GetJob", _MODEL_PREFETCH, ("202",), ("get", "/v1/jobs/{job_id}"), {"job_id": _JOB_ID}),
    Link(
        "CancelJob", _MODEL_PREFETCH, ("202",), ("delete", "/v1/jobs/{job_id}"), {"job_id": _JOB_ID}
    ),
    Link(
        "ListMigrations",
        ("post", "/v1/migrations"),
        ("200", "202"),
        ("get", "/v1/migrations"),
        {"file_id": "$response.body#/migrations/0/file_id"},
    ),
]
"""Every link of the document."""


# -- completing the document ----------------------------------------------------------------------
def _operations(doc: Doc) -> Iterator[tuple[str, str, Doc]]:
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            if isinstance(op, dict) and "responses" in op:
                yield method, path, op


def _walk(node: Any) -> Iterator[Doc]:
    """Every JSON object in ``node``, depth first."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _branches(schema: Doc) -> Iterator[Doc]:
    """``schema`` and its ``anyOf`` alternatives (``X | None`` is ``anyOf: [X, null]``)."""
    yield schema
    yield from schema.get("anyOf", ())


def _typed(schema: Doc, json_type: str) -> Iterator[Doc]:
    return (b for b in _branches(schema) if b.get("type") == json_type)


def _add_links(doc: Doc) -> None:
    ops = {(method, path): op for method, path, op in _operations(doc)}
    for link in LINKS:
        source, target = ops.get(link.source), ops.get(link.target)
        if source is None or target is None:
            raise LookupError(f"link {link.name}: {link.source} or {link.target} is no operation")
        obj: Doc = {"operationId": target["operationId"]}
        if link.description:
            obj["description"] = link.description
        if link.parameters:
            obj["parameters"] = dict(link.parameters)
        if link.body is not None:
            obj["requestBody"] = link.body
        obj.update(link.extra)
        for status in link.statuses:
            source["responses"][status].setdefault("links", {})[link.name] = obj


def _validation_errors_are_error_bodies(doc: Doc) -> None:
    schemas = doc["components"]["schemas"]
    assert "ErrorBody" in schemas, "no route declares the error body"
    error_body = {"$ref": "#/components/schemas/ErrorBody"}
    for _, _, op in _operations(doc):
        invalid = op["responses"].get("422")
        if invalid is None:
            continue
        media = invalid.get("content", {}).get("application/json", {})
        if media.get("schema", {}).get("$ref", "").endswith("/HTTPValidationError"):
            invalid["description"] = "Invalid parameters or body"
            media["schema"] = error_body
    for name in ("HTTPValidationError", "ValidationError"):
        if name in schemas and f"/{name}" not in str(doc["paths"]):
            del schemas[name]


def _json_bodies_may_be_415(doc: Doc) -> None:
    (described,) = NOT_JSON.values()
    error_body = {"$ref": "#/components/schemas/ErrorBody"}
    for method, _, op in _operations(doc):
        json_body = "application/json" in op.get("requestBody", {}).get("content", {})
        if json_body or method == "post":
            op["responses"].setdefault(
                "415",
                {
                    "description": described["description"],
                    "content": {"application/json": {"schema": error_body}},
                },
            )


def _browser_guard(doc: Doc, settings: Settings) -> None:
    """A tierd without tokens answers a foreign ``Host`` with 421 on every route, and a request
    a page of another site made with 403 (:mod:`app.browsers`)."""
    if settings.host_names() is None:
        return
    schema = {"$ref": "#/components/schemas/ErrorBody"}
    error_body = {"content": {"application/json": {"schema": schema}}}
    for _, _, op in _operations(doc):
        op["responses"].setdefault(
            "421",
            {"description": "The Host header names no host this tierd answers to (DNS rebinding)"}
            | error_body,
        )
        op["responses"].setdefault(
            "403",
            {"description": "Refused: a request a web page of another site made (no tokens)"}
            | error_body,
        )


def _settings_bounds(doc: Doc, settings: Settings) -> None:
    schemas = doc["components"]["schemas"]
    limits = settings.buffers
    for schema in schemas.values():
        ttl = schema.get("properties", {}).get("ttl_s")
        if ttl is not None:
            for number in _typed(ttl, "number"):
                number["maximum"] = limits.max_ttl_s
    lists = [("GatherRequest", "indices", limits.max_gather_indices)]
    lists += [("BatchRequest", "items", limits.max_batch_items)]
    for name in ("SafetensorsRequest", "PrefetchRequest"):
        lists += [
            (name, "file_ids", limits.max_batch_items),
            (name, "paths", limits.max_batch_items),
        ]
    for name, prop, most in lists:
        for array in _typed(schemas[name]["properties"][prop], "array"):
            array["maxItems"] = most
    # Where a file may live: a memory tier holds copies only (naming it is a 422).
    tiers = [t.name for t in settings.tiers if t.kind != "memory"]
    names = [
        schemas["MoveRequest"]["properties"]["to_tier"],
        schemas["PinRequest"]["properties"]["tier"],
    ]
    for _, _, op in _operations(doc):
        names += [p["schema"] for p in op.get("parameters", ()) if p["name"] == "tier"]
    for schema in names:
        for string in _typed(schema, "string"):
            string["enum"] = tiers


def _exact_integer_bounds(doc: Doc) -> None:
    for node in _walk(doc):
        if node.get("type") != "integer":
            continue
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            value = node.get(key)
            if isinstance(value, float) and value.is_integer():
                node[key] = MAX_ID if value >= MAX_ID else int(value)


def _request_id_and_auth(doc: Doc, settings: Settings) -> None:
    header = {
        "description": "The request's id (the client's, when sane, else a new one); also in "
        "error bodies and log lines",
        "required": True,
        "schema": {"type": "string"},
    }
    for _, _, op in _operations(doc):
        for response in op["responses"].values():
            response.setdefault("headers", {})[REQUEST_ID_HEADER] = header
        if settings.auth_enabled and "401" in op["responses"]:
            op["security"] = [{"bearer": []}]
    if settings.auth_enabled:
        doc["components"].setdefault("securitySchemes", {})["bearer"] = {
            "type": "http",
            "scheme": "bearer",
            "description": "The admin token (every route) or the data token (data routes)",
        }


def complete_openapi(doc: Doc, settings: Settings) -> Doc:
    """Complete FastAPI's document ``doc`` in place (see the module's docstring); returns it."""
    _exact_integer_bounds(doc)
    _validation_errors_are_error_bodies(doc)
    _json_bodies_may_be_415(doc)
    _browser_guard(doc, settings)
    _settings_bounds(doc, settings)
    _request_id_and_auth(doc, settings)
    _add_links(doc)
    return doc


def install_openapi(app: FastAPI, settings: Settings) -> None:
    """Serve the completed document at ``/openapi.json`` (and ``/docs``)."""
    fastapi_openapi: Callable[[], Doc] = app.openapi
    built: dict[str, Doc] = {}

    def openapi() -> Doc:
        base = fastapi_openapi()  # FastAPI's, cached by FastAPI until the routes change
        if built.get("base") is not base:
            built["doc"] = complete_openapi(copy.deepcopy(base), settings)
            built["base"] = base
        return built["doc"]

    app.openapi = openapi  # type: ignore[method-assign]
