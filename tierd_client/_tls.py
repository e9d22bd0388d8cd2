"""One TLS context for the process's HTTP clients.

httpx builds a new ``ssl.SSLContext`` for every client and loads the whole CA bundle into it:
about 35 ms of CPU a client (measured on the 2-core CI machine). A program that makes a client
per request or per worker pays that each time, though the context would be the same; so every
client tierd_client makes shares this one, made at first use.
"""

from __future__ import annotations

import functools
import ssl

import httpx

__all__ = ["tls_context"]


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default context (its CA bundle, ``SSL_CERT_FILE`` honoured), made once."""
    return httpx.create_ssl_context()
