"""`flashrec serve`: load the engine, then run the HTTP API under uvicorn in this process (the
engine too, or, with `--engine-process`, in a process of its own: engine_process.py).

Loading happens before the port opens, so a bad checkpoint or catalog fails the command (exit
code 2) instead of leaving a server that never becomes ready. Warm-up runs after the port opens
(/health answers, /ready turns 200 when it is done). SIGTERM or Ctrl-C: uvicorn stops accepting
connections and lets requests in flight finish (up to `shutdown_grace_s`), then the engine loop
drains and the process exits 0.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Any

from flashrec_core.server.settings import ServerSettings

logger = logging.getLogger("flashrec.server")
SWITCH_INTERVAL_S = 0.0005


def serve(settings: ServerSettings) -> int:
    import uvicorn

    from flashrec_core.server.app import create_app

    engine: Any
    if settings.engine_process:
        from flashrec_core.server.engine_process import RemoteEngine

        engine = RemoteEngine.start(settings)
    else:
        from flashrec_core.server.loading import load_engine

        engine = load_engine(settings)
    app = create_app(engine, settings)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, access_log=False, log_level="info",
        timeout_graceful_shutdown=max(1, int(settings.shutdown_grace_s)),
        log_config=None,  # keep the process's logging setup (one format for engine and server)
    )  # fmt: skip
    server = uvicorn.Server(config)
    # The engine thread launches kernels between short GIL releases; with the default 5 ms
    # switch interval a busy HTTP thread can hold it off for whole intervals per launch.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    if settings.api_key is None and settings.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without an API key (--api-key)", settings.host)
    # uvicorn drains, restores the handlers it found, then re-raises the signal it caught: with
    # this one in place that ends the command normally (exit 0) instead of killing the process.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _drained)
    try:
        server.run()
    finally:  # uvicorn exits without its shutdown when it cannot bind the port
        if settings.engine_process and engine.loop.running:
            engine.loop.stop(0)
    return 0


def _drained(signum: int, _frame: object) -> None:
    """uvicorn re-raises every stop signal it caught once it has drained (two for a double
    Ctrl-C): log the first, and ignore the rest, the process being about to exit."""
    logger.info("stopped by %s after draining", signal.Signals(signum).name)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
