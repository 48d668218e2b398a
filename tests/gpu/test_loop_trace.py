"""The profiler window on a GPU: kernels and CUDA graph replays are traced and the summary puts
their GPU time under the loop phase that launched them (the CPU tests see no kernels)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashrec_core.bench.trace_summary import load_events, summarize
from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.engine import Engine
from flashrec_core.registry import Registry
from flashrec_core.testing.beam_conformance import LEVELS, random_codes, write_catalog
from flashrec_core.testing.checkpoint import gpu_shape, write_tiny_checkpoint

pytestmark = pytest.mark.gpu


def test_a_window_attributes_kernels_and_graph_replays_to_loop_phases(tmp_path: Path) -> None:
    spec = Registry.discover().resolve("Qwen3ForCausalLM")
    write_tiny_checkpoint(tmp_path, gpu_shape(spec.examples[0].hf_config), level_sizes=LEVELS)
    catalog = write_catalog(tmp_path / "c.json", random_codes(400, seed=3))
    cfg = EngineConfig(
        model_path=str(tmp_path), device="cuda", show_progress=False, kv_cache_tokens=1 << 15,
        max_wave_rows=256, quantization="none",
    )  # fmt: skip
    engine = Engine.from_config(cfg, SearchConfig(catalog_path=str(catalog)))
    reqs = [engine.make_request(prompt=f"user w{i} w{i + 3} item", n=8) for i in range(3)]
    engine.generate(reqs)  # captures the graphs outside the window
    loop = engine.loop
    loop.trace.start()  # no loop thread: Engine.generate drives the loop on this thread
    engine.generate([engine.make_request(prompt=f"user w{i} w9 item", n=8) for i in range(3)])
    prof, started = loop.trace.close()
    trace, _ = loop.trace.write(prof, started, tmp_path / "traces")
    s = summarize(load_events(trace))
    assert s["iterations"] >= len(LEVELS)  # prefill + first selection, then one per beam step
    assert s["gpu_busy_share"] is not None and s["gpu_busy_share"] > 0
    step, admit = s["phases"]["step"], s["phases"]["admit"]
    # one wave: each beam step replays its whole-step graph; the prefill its prefill graph
    launches = step["graph_launches_per_iteration"] * s["iterations"]
    assert launches == pytest.approx(len(LEVELS) - 1)
    assert step["gpu_ms_per_iteration"] > 0 and admit["gpu_ms_per_iteration"] > 0
