"""The offline engine: load a GenRec checkpoint once, then `generate` ranked items many times.

engine = Engine.from_config(EngineConfig(model_path=DIR), SearchConfig(catalog_path=FILE))
[result] = engine.generate([engine.make_request(prompt="user history w1 w2", n=10)])
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.beam_wave import BeamWave
from flashrec_core.engine.front import EngineFront, load_front_parts
from flashrec_core.engine.handles import Limits
from flashrec_core.engine.loop import EngineLoop, wait_all
from flashrec_core.engine.model_runner import ModelRunner
from flashrec_core.engine.requests import GenerationRequest, GenerationResult
from flashrec_core.registry import Registry
from flashrec_core.search.catalog import Catalog
from flashrec_core.search.lm_head import RestrictedLMHead
from flashrec_core.search.sid_layout import SidLayout
from flashrec_core.search.trie import Trie, build_trie
from flashrec_core.search.unconstrained import UnconstrainedTrie

logger = logging.getLogger("flashrec")


class Engine(EngineFront):
    """A front (tokenizer, SID layout, catalogs) + model runner + restricted head + the loop."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Any,
        layout: SidLayout,
        catalog: Catalog | None,
        search: SearchConfig,
        max_queue: int = 1024,
    ) -> None:
        self.runner = runner
        self.trie = self._create_trie(catalog, layout, search, runner.device)
        """The startup default catalog's trie (its depth is every catalog's depth)."""
        super().__init__(
            tokenizer, layout, catalog, search, self.trie.to("cpu"), runner.config.vocab_size
        )
        self.catalogs.get()._device_trie = self.trie
        head = RestrictedLMHead(
            runner.lm_head(), runner.lm_head_bias(), layout, search.sid_normalization,
            logit_softcap=runner.final_logit_softcap,
        )  # fmt: skip
        self.wave = BeamWave(runner, head, self.trie, layout, self.catalog_index)
        ecfg = runner.loaded.engine_config
        limits = Limits(
            max_wave_rows=ecfg.max_wave_rows, max_context=runner.request_table.max_context,
            max_position=runner.config.max_position, depth=self.trie.depth, max_queue=max_queue,
        )  # fmt: skip
        self.loop = EngineLoop(self.wave, self.decoder, limits)
        """Admits, steps and retires requests; `generate` and the server are its clients."""
        self.loop.schedule = ecfg.schedule
        on_gpu = runner.device.type == "cuda"
        self.loop.intra_op_threads = ecfg.host_threads or (1 if on_gpu else None)
        self.loop.prefill_tokens_per_step = ecfg.prefill_tokens_per_step
        self.loop.mixed_prefill_steps = ecfg.mixed_prefill_steps

    @classmethod
    def from_config(
        cls,
        engine_config: EngineConfig,
        search: SearchConfig | None = None,
        registry: Registry | None = None,
        max_queue: int = 1024,
    ) -> Engine:
        search = search or SearchConfig()
        _, tokenizer, layout, catalog = load_front_parts(engine_config, search, registry)
        runner = ModelRunner.from_config(engine_config, registry, sid_depth=layout.depth)
        return cls(runner, tokenizer, layout, catalog, search, max_queue)

    @staticmethod
    def _create_trie(
        catalog: Catalog | None, layout: SidLayout, search: SearchConfig, device: torch.device
    ) -> Trie:
        if catalog is None:
            return UnconstrainedTrie(layout.level_sizes, device)
        return build_trie(catalog.codes, catalog.level_sizes, kind=search.trie_kind).to(device)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Run beam search for every request through the engine loop (requests of one n share
        waves); results come back in request order. A request the engine can never serve
        raises RequestRejectedError before any work starts. A request without a catalog
        version gets the current default one (so it shares that version's CUDA graphs and
        follows a reload of `default`)."""
        default = self.catalogs.get()
        requests = [r if r.catalog is not None else replace(r, catalog=default) for r in requests]
        for req in requests:
            self.loop.check(req)
        handles = [self.loop.submit(r, bounded=False) for r in requests]
        return wait_all(self.loop, handles)
