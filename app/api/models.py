"""Models: Hugging Face model directories as one unit. List, show, load, prefetch, pin.

A model is named by its directory's relpath (``models/llama-3-8b``), which holds ``/``. The
name travels as the ``name`` query parameter on every route, not in the URL path, the way
``GET /v1/files/lookup?path=`` names a file. A ``{name:path}`` path parameter followed by an
action (``/v1/models/{name}/load``) is ambiguous: the model ``x/load`` and the action ``load``
of the model ``x`` are the same URL, and so a ``PUT`` to it could not say which methods are
allowed (``Allow`` must list those of one documented path). A query parameter also takes any
relpath as it is, with nothing of it taken for a route.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated

from fastapi import APIRouter, Query, Response
from fastapi.responses import JSONResponse

from app.api.deps import EngineDep, LoaderDep
from app.api.responses import (
    ADMIN,
    BUSY,
    CONFLICT,
    DATA,
    INVALID,
    JSON_BODY,
    NO_SPACE,
    NOT_FOUND,
    RANGE,
    TOO_LARGE,
)
from app.auth import require_admin, require_data
from app.errors import HttpError
from app.schemas import PinRequest
from app.schemas_devices import DevicesTensorsOut, tensors_json
from app.schemas_loads import JobOut, SafetensorsOut
from app.schemas_models import (
    ModelDetail,
    ModelFilesOut,
    ModelList,
    ModelLoadRequest,
    ModelOut,
    ModelPrefetchRequest,
)
from tiering.engine import Engine
from tiering.serving import Loader, ModelInfo
from tiering.tiers.paths import MAX_RELPATH_CHARS

router = APIRouter(prefix="/v1/models", tags=["models"])

MAX_PAGE = 1000
LOAD_ERRORS = DATA | NOT_FOUND | CONFLICT | RANGE | TOO_LARGE | JSON_BODY | BUSY | NO_SPACE

# The engine checks a relpath's rules (and answers ``invalid_path`` with the rule broken); the
# schema states the length bound it enforces, while pydantic only caps what is read at 4x that.
NameQuery = Annotated[
    str,
    Query(
        max_length=MAX_RELPATH_CHARS * 4,
        description="The model: its directory's relpath, e.g. models/llama-3-8b",
        json_schema_extra={"minLength": 1, "maxLength": MAX_RELPATH_CHARS},
    ),
]


def _encode_cursor(name: str) -> str:
    return base64.urlsafe_b64encode(f"model:{name}".encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> str:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raw = ""
    kind, _, name = raw.partition(":")
    if kind != "model" or not name:
        raise HttpError(422, "invalid_cursor", "cursor is not one this server issued")
    return name


def _files(engine: Engine, loader: Loader, info: ModelInfo) -> ModelFilesOut:
    return ModelFilesOut.build(info, loader.models.summary(info), engine.heat)


@router.get("", dependencies=[require_data], responses=DATA | INVALID | BUSY)
def list_models(
    loader: LoaderDep,
    prefix: Annotated[
        str | None, Query(max_length=MAX_RELPATH_CHARS, description="Model name prefix")
    ] = None,
    cursor: Annotated[str | None, Query(max_length=MAX_RELPATH_CHARS * 2)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
) -> ModelList:
    """Models (directories directly holding ``*.safetensors``), by name, a page at a time:
    their files' totals, and the tiers and heat of their weights. Indexes are not read here;
    ``GET /v1/models/lookup`` checks one."""
    after = _decode_cursor(cursor) if cursor else None
    infos, more = loader.models.page(prefix=prefix, after=after, limit=limit)
    return ModelList(
        items=[ModelOut.of(loader.models.summary(i)) for i in infos],
        next_cursor=_encode_cursor(infos[-1].name) if more and infos else None,
    )


@router.get("/lookup", dependencies=[require_data], responses=DATA | NOT_FOUND | INVALID | BUSY)
def get_model(name: NameQuery, engine: EngineDep, loader: LoaderDep) -> ModelDetail:
    """One model: its files, and its layout (the shards a load reads, from its index if it has
    one). 404 for a name that is no model; 422 for an index that does not validate, naming the
    problem (bad JSON, no weight map, a shard that is not there, a tensor mapped twice)."""
    info, lay = loader.models.layout(name)
    return ModelDetail.detail(info, loader.models.summary(info), lay, engine.heat)


@router.post(
    "/load",
    dependencies=[require_data],
    response_model=SafetensorsOut | DevicesTensorsOut,
    responses=LOAD_ERRORS,
)
def load_model(
    name: NameQuery, loader: LoaderDep, body: ModelLoadRequest | None = None
) -> Response:
    """Load a model's tensors (all, ``names``, or those starting with ``prefix``) into one
    buffer per shard, the shards concurrently. The body is that of
    ``POST /v1/load/safetensors`` (``devices``, ``sharding`` and ``rank`` included) less the
    files, plus ``prefix``, and so is the reply. Every shard's header is checked against the
    others and the index before anything is leased: a tensor in two shards, or where the index
    does not put it, is a 422 naming it, and nothing stays leased after any error."""
    req = body or ModelLoadRequest()
    target = req.target()
    loads = loader.models.load(
        name,
        names=req.names,
        prefix=req.prefix,
        device=target,
        ttl_s=req.ttl_s,
        shared=req.shared,
        wait=req.wait,
    )
    return Response(tensors_json(target, loads), media_type="application/json")


@router.post(
    "/prefetch",
    status_code=202,
    dependencies=[require_data],
    responses=DATA | NOT_FOUND | RANGE | TOO_LARGE | JSON_BODY | BUSY | NO_SPACE,
)
def prefetch_model(name: NameQuery, req: ModelPrefetchRequest, loader: LoaderDep) -> JSONResponse:
    """Warm every file of a model with one job (``gpu``, ``memory``, ``nvme`` or
    ``page_cache``); returns the job at once. Follow it at ``GET /v1/jobs/{id}``."""
    job = loader.models.prefetch(name, target=req.target, device=req.device, ttl_s=req.ttl_s)
    return JSONResponse(
        JobOut.of(job).model_dump(mode="json"),
        status_code=202,
        headers={"Location": f"/v1/jobs/{job.id}"},
    )


@router.post(
    "/pin",
    dependencies=[require_admin],
    responses=ADMIN | NOT_FOUND | CONFLICT | JSON_BODY | BUSY,
)
def pin_model(
    name: NameQuery, engine: EngineDep, loader: LoaderDep, body: PinRequest | None = None
) -> ModelFilesOut:
    """Pin every file of the model to ``tier`` (default: the tier holding most of its weight
    bytes), in one catalog transaction: all, or none (409 while a file is being migrated to
    another tier). Policy then keeps the model there, whole."""
    info = loader.models.pin(name, (body or PinRequest()).tier)
    return _files(engine, loader, info)


@router.delete(
    "/pin",
    dependencies=[require_admin],
    responses=ADMIN | NOT_FOUND | CONFLICT | INVALID | BUSY,
)
def unpin_model(name: NameQuery, engine: EngineDep, loader: LoaderDep) -> ModelFilesOut:
    """Remove the pins of every file of the model; policy moves it by heat again, whole."""
    return _files(engine, loader, loader.models.unpin(name))
