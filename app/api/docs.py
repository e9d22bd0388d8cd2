"""``/docs``: Swagger UI served from this package, never from a CDN.

GPU hosts often reach no internet, and FastAPI's own ``/docs`` page loads Swagger UI's script and
stylesheet from a CDN, so it was blank there. The assets come from the ``swagger-ui-bundle-v2``
package (Swagger UI 5, which renders OpenAPI 3.1; the older ``swagger-ui-bundle`` ships 4.x,
which does not), mounted at ``/docs/assets``. ReDoc has no such package and is not served.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from starlette.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

__all__ = ["ASSETS", "install_docs"]

ASSETS = "/docs/assets"


def install_docs(app: FastAPI) -> None:
    """Serve Swagger UI at ``/docs`` for ``app.openapi_url``, its assets from the package."""
    app.mount(ASSETS, StaticFiles(directory=str(swagger_ui_path)), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{app.title} - API",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon-32x32.png",
        )
