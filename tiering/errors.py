"""The one exception tree of tierd's engine.

Every error the engine raises on purpose is a :class:`TierdError`. Each class has a stable
snake_case ``code`` that clients can switch on. HTTP knows nothing here: ``app.errors`` maps
these classes to status codes in exactly one place.

::

    TierdError
    ├── InvalidInput                  bad arguments from a caller (also a ValueError)
    │   ├── InvalidPath               relpath is absolute, has '..', NUL, is too long, ...
    │   ├── InvalidRange              offset/length outside the file, malformed Range header
    │   ├── InvalidPolicy             a policy document that does not validate
    │   ├── InvalidDevice             a device string that names no device here
    │   ├── InvalidSharding           a tensor-parallel sharding spec that does not fit
    │   ├── CacheOnlyTier             a memory tier named where a file's home tier is wanted
    │   ├── InvalidDtype              unknown dtype, or one that does not divide the length
    │   ├── MisalignedBuffer          a buffer or offset not on the required alignment
    │   ├── IndexOutOfRange           vector row indices outside the matrix
    │   ├── MalformedFile             a safetensors header that is truncated or wrong
    │   │   └── InvalidModel          a model directory whose index or shards do not agree
    │   └── ChecksumMismatch          uploaded bytes that do not hash to the checksum sent
    ├── NotFound
    │   ├── FileNotFound              no catalog record (or no bytes on disk) for that id/path
    │   ├── TierNotFound              no tier of that name
    │   ├── ModelNotFound             no model (directory with safetensors weights) of that name
    │   ├── BufferNotFound            no lease with that id
    │   └── JobNotFound               no prefetch job with that id
    ├── Conflict
    │   ├── AlreadyExists             relpath exists and overwrite was not asked for
    │   ├── FileBusy                  the file is migrating, pinned elsewhere, or changed under us
    │   ├── PathConflict              a file beneath a file, or over a directory of files
    │   ├── FileChanged               the bytes in storage are not the version the catalog has
    │   └── PreconditionFailed        the file is not the version a conditional request named
    ├── TooLarge                      a body or request over a configured limit
    ├── InsufficientSpace             a tier or device is out of space, quota or budget
    ├── Unavailable                   temporarily unable to serve
    │   ├── CatalogBusy               SQLite stayed locked past busy_timeout
    │   ├── CatalogUnreachable        the catalog's database (PostgreSQL) cannot be reached
    │   │   └── HostLockLost          another tierd with this host id took its lock: no writes
    │   └── TierUnavailable           a tier's storage cannot be reached or written (a bucket)
    ├── IntegrityError                bytes do not match their checksum, or the source changed
    ├── StorageError                  a tier's filesystem failed (EIO, EACCES, EROFS...)
    ├── BackendUnavailable            an explicitly requested I/O backend is not installed here
    └── ClosedFile                    an operation on a closed handle
"""

from __future__ import annotations

__all__ = [
    "AlreadyExists",
    "BackendUnavailable",
    "BufferNotFound",
    "CacheOnlyTier",
    "CatalogBusy",
    "CatalogUnreachable",
    "ChecksumMismatch",
    "ClosedFile",
    "Conflict",
    "FileBusy",
    "FileChanged",
    "FileNotFound",
    "HostLockLost",
    "IndexOutOfRange",
    "InsufficientSpace",
    "IntegrityError",
    "JobNotFound",
    "InvalidDevice",
    "InvalidDtype",
    "InvalidInput",
    "InvalidModel",
    "InvalidPath",
    "InvalidPolicy",
    "InvalidRange",
    "InvalidSharding",
    "MalformedFile",
    "MisalignedBuffer",
    "ModelNotFound",
    "NotFound",
    "PathConflict",
    "PreconditionFailed",
    "StorageError",
    "TierNotFound",
    "TierUnavailable",
    "TierdError",
    "TooLarge",
    "Unavailable",
]


class TierdError(Exception):
    """Base of every error tierd raises on purpose.

    Parameters
    ----------
    message:
        A sentence for a person: what was wrong and, where it helps, what to do.
    **details:
        Machine-readable extras (sizes, limits, ids) that clients may show.
    """

    code = "tierd_error"

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class InvalidInput(TierdError, ValueError):
    code = "invalid_input"


class InvalidPath(InvalidInput):
    code = "invalid_path"


class ChecksumMismatch(InvalidInput):
    """Uploaded bytes that do not hash to the checksum the caller sent with them: nothing was
    published or recorded."""

    code = "checksum_mismatch"


class InvalidRange(InvalidInput):
    code = "invalid_range"


class InvalidPolicy(InvalidInput):
    code = "invalid_policy"


class InvalidDevice(InvalidInput):
    code = "invalid_device"


class InvalidSharding(InvalidInput):
    """A sharding spec (world size, rules, rank) that does not fit the tensors it splits."""

    code = "invalid_sharding"


class CacheOnlyTier(InvalidInput):
    """The memory tier holds cached copies only: no file lives there (no upload, move or pin)."""

    code = "cache_only_tier"


class InvalidDtype(InvalidInput):
    code = "invalid_dtype"


class MisalignedBuffer(InvalidInput):
    code = "misaligned_buffer"


class IndexOutOfRange(InvalidInput, IndexError):
    code = "index_out_of_range"


class MalformedFile(InvalidInput):
    code = "malformed_file"


class InvalidModel(MalformedFile):
    code = "invalid_model"


class NotFound(TierdError, LookupError):
    code = "not_found"


class FileNotFound(NotFound):
    code = "file_not_found"


class TierNotFound(NotFound):
    code = "tier_not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class BufferNotFound(NotFound):
    code = "buffer_not_found"


class JobNotFound(NotFound):
    code = "job_not_found"


class Conflict(TierdError):
    code = "conflict"


class AlreadyExists(Conflict):
    code = "already_exists"


class PreconditionFailed(Conflict):
    """A conditional request (``If-Match``, ``If-None-Match: *``) whose condition the file does
    not meet: nothing was read or written."""

    code = "precondition_failed"


class FileBusy(Conflict):
    code = "file_busy"


class PathConflict(Conflict):
    """A file would sit beneath another file, or over a directory of files: no tier can hold
    both, and the first move between tiers would quarantine one of them."""

    code = "path_conflict"


class FileChanged(Conflict):
    code = "file_changed"


class TooLarge(TierdError):
    code = "too_large"


class InsufficientSpace(TierdError):
    code = "insufficient_space"


class Unavailable(TierdError):
    code = "unavailable"


class CatalogBusy(Unavailable):
    code = "catalog_busy"


class CatalogUnreachable(Unavailable):
    """The catalog's database cannot be reached (PostgreSQL down or cut off).

    Keeps the code ``unavailable``: clients already retry on it, and nothing they can do
    differs from any other 503 (the message names the catalog and the reason).
    """


class HostLockLost(CatalogUnreachable):
    """Another tierd with this host id took the host's lock while PostgreSQL had dropped ours
    (a restart): this process writes nothing to the catalog any more, so two processes never
    act as one host. It is a :class:`CatalogUnreachable` for everything that pauses on one."""


class TierUnavailable(Unavailable):
    code = "tier_unavailable"


class IntegrityError(TierdError):
    code = "integrity_error"


class StorageError(TierdError):
    code = "storage_error"


class BackendUnavailable(TierdError, ImportError):
    code = "backend_unavailable"


class ClosedFile(TierdError):
    code = "closed_file"
