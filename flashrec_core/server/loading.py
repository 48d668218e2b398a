"""The serving engine built from `ServerSettings`, and the facts about it that the HTTP side
reports (`/v1/models`, the ready line of the log). Shared by the in-process server and the engine
process (`engine_process.py`)."""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

import torch

from flashrec_core.engine.engine import Engine
from flashrec_core.server.settings import ServerSettings

logger = logging.getLogger("flashrec.server")


def load_engine(settings: ServerSettings) -> Engine:
    """Load the checkpoint and catalogs and set the loop's serving knobs (the loop not started).

    Every torch CPU op of a serving process runs on the engine thread; the intra-op threads go
    there (EngineLoop.start). A second OpenMP team, made by loading with all threads on this
    thread, leaves libgomp with more threads than cores: it then stops spin-waiting between
    parallel regions, and every CPU op pays a wake-up (a CPU request took 28 ms instead of 18 ms
    on 2 cores; docs/serving.md). On CUDA the engine takes 1 (EngineConfig.host_threads)."""
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
    return engine


def model_facts(engine: Engine) -> dict[str, Any]:
    """What /v1/models says about the model beyond the settings (the engine's side of it)."""
    from flashrec_core.bench.roofline import served_model

    return {
        "architectures": list(engine.runner.loaded.spec.architectures),
        "roofline": asdict(served_model(engine)),
    }


def device_memory(engine: Engine) -> str:
    """Where the device's memory stands after warm-up, for the log: the KV pool, the CUDA graphs'
    private pools, torch's peak, and what prefills beside them have left (the split that
    `--mem-fraction` sets; docs/serving.md)."""
    device = engine.runner.device
    if device.type != "cuda":
        return ""
    free, total = torch.cuda.mem_get_info(device)
    gib = 2**30
    return (
        f"; device memory: KV pool {engine.runner.kv_pool.nbytes / gib:.1f} GiB, CUDA graph "
        f"pools {graph_pool_bytes(device) / gib:.1f} GiB, peak allocated "
        f"{torch.cuda.max_memory_allocated(device) / gib:.1f} GiB, "
        f"{torch.cuda.memory_reserved(device) / gib:.1f} GiB reserved by torch, "
        f"{free / gib:.1f} of {total / gib:.1f} GiB free"
    )


def graph_pool_bytes(device: torch.device) -> int:
    """Bytes of the segments torch's allocator holds in private pools (CUDA graphs' memory):
    segments of the default pool carry pool id (0, 0)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return sum(
        seg["total_size"]
        for seg in torch.cuda.memory_snapshot()
        if seg.get("device", index) == index and tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)
    )
