"""The Python client moved to :mod:`tierd_client`, which installs without the server.

This module keeps ``from app.client import Client`` working; new code imports
``tierd_client``.
"""

from __future__ import annotations

from tierd_client import *  # noqa: F403
from tierd_client import __all__ as __all__
