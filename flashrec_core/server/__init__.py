"""The OpenAI-compatible HTTP server (`flashrec serve`) and the offline batch runner.

Import `create_app` / `serve` from here; FastAPI and uvicorn are imported only by this package,
so the engine runs without them.
"""

from flashrec_core.server.settings import ServerSettings, load_settings

__all__ = ["ServerSettings", "load_settings"]
