"""Serving: loads for other processes. The loader turns requests into buffers, leases hand
them out with a TTL and a per-device budget, and jobs run prefetches in the background."""

from __future__ import annotations

from tiering.io.target import LoadTarget
from tiering.serving.config import FileRef, LoaderConfig
from tiering.serving.jobs import Job, JobCancelled, JobTable
from tiering.serving.leases import Lease, LeaseTable, Reservation
from tiering.serving.loader import Loader
from tiering.serving.loads import LoadItem
from tiering.serving.models import ModelInfo, Models, ModelSummary
from tiering.serving.prefetch import PREFETCH_TARGETS
from tiering.serving.replicas import Replica
from tiering.serving.safetensors import TensorLoc, TensorsLoaded
from tiering.serving.sharded import DeviceLoaded

__all__ = [
    "PREFETCH_TARGETS",
    "DeviceLoaded",
    "FileRef",
    "Job",
    "JobCancelled",
    "JobTable",
    "Lease",
    "LeaseTable",
    "LoadItem",
    "LoadTarget",
    "Loader",
    "LoaderConfig",
    "ModelInfo",
    "ModelSummary",
    "Models",
    "Replica",
    "Reservation",
    "TensorLoc",
    "TensorsLoaded",
]
