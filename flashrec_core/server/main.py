"""`flashrec serve`: load the engine, then run the HTTP API under uvicorn in this process.

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

from flashrec_core.server.settings import ServerSettings

logger = logging.getLogger("flashrec.server")
SWITCH_INTERVAL_S = 0.0005


def serve(settings: ServerSettings) -> int:
    import torch
    import uvicorn

    from flashrec_core.engine.engine import Engine
    from flashrec_core.server.app import create_app

    # Every torch CPU op of a serving process runs on the engine thread; the intra-op threads go
    # there (EngineLoop.start). A second OpenMP team, made by loading with all threads on this
    # thread, leaves libgomp with more threads than cores: it then stops spin-waiting between
    # parallel regions, and every CPU op pays a wake-up (a CPU request took 28 ms instead of
    # 18 ms on 2 cores; docs/serving.md). On CUDA the engine takes 1 (EngineConfig.host_threads).
    engine_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    logger.info("loading %s", settings.engine.model_path)
    engine = Engine.from_config(settings.engine, settings.search, max_queue=settings.max_queue)
    if engine.loop.intra_op_threads is None:  # on CPU: every core, captured before the load
        engine.loop.intra_op_threads = engine_threads
    logger.info("engine thread: %d CPU threads", engine.loop.intra_op_threads)
    engine.loop.admission_delay_factor = settings.admission_delay_factor
    for name, path in settings.catalogs.items():
        number = engine.add_catalog(name, path)[0].version  # keep no reference: it may be swapped
        logger.info("catalog %s: %s (version %d)", name, path, number)
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
    server.run()
    return 0


def _drained(signum: int, _frame: object) -> None:
    logger.info("stopped by %s after draining", signal.Signals(signum).name)
