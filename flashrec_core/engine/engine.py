"""The offline engine: load a GenRec checkpoint once, then `generate` ranked items many times.

engine = Engine.from_config(EngineConfig(model_path=DIR), SearchConfig(catalog_path=FILE))
[result] = engine.generate([engine.make_request(prompt="user history w1 w2", n=10)])
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.beam_wave import BeamWave
from flashrec_core.engine.catalogs import DEFAULT_CATALOG, CatalogSet, CatalogVersion
from flashrec_core.engine.handles import Limits
from flashrec_core.engine.loop import EngineLoop, wait_all
from flashrec_core.engine.model_runner import ModelRunner
from flashrec_core.engine.requests import GenerationRequest, GenerationResult, ResultDecoder
from flashrec_core.registry import Registry, read_model_config
from flashrec_core.search.catalog import Catalog, CatalogError
from flashrec_core.search.catalog_formats import load_catalog
from flashrec_core.search.filters import AttrFilters, CatalogIndex, FilterError, ItemFilter
from flashrec_core.search.lm_head import RestrictedLMHead
from flashrec_core.search.sid_layout import SidLayout, infer_sid_layout
from flashrec_core.search.trie import Trie, build_trie
from flashrec_core.search.unconstrained import UnconstrainedTrie

logger = logging.getLogger("flashrec")


class Engine:
    """Model runner + tokenizer + SID layout + catalog trie + restricted head."""

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
        self.tokenizer = tokenizer
        self.layout = layout
        self.search = search
        self.trie = self._create_trie(catalog, layout, search, runner.device)
        """The startup default catalog's trie (its depth is every catalog's depth)."""
        head = RestrictedLMHead(
            runner.lm_head(), runner.lm_head_bias(), layout, search.sid_normalization,
            logit_softcap=runner.final_logit_softcap,
        )  # fmt: skip
        index = CatalogIndex(catalog) if catalog is not None else None
        self.catalogs = CatalogSet()
        """Named catalogs, each at its current version; requests bind one when made."""
        default = self._new_version(DEFAULT_CATALOG, catalog, self.trie.to("cpu"), index,
                                    search.catalog_path or "<none>")  # fmt: skip
        default._device_trie = self.trie
        self.catalogs.put(default)
        self.wave = BeamWave(runner, head, self.trie, layout, index)
        self.decoder = default.decoder
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

    @property
    def catalog(self) -> Catalog | None:
        """The current default catalog."""
        return self.catalogs.get().catalog

    @property
    def catalog_index(self) -> CatalogIndex | None:
        return self.catalogs.get().index

    def _new_version(
        self, name: str, catalog: Catalog | None, host_trie: Trie, index: CatalogIndex | None,
        source: str,
    ) -> CatalogVersion:  # fmt: skip
        decoder = ResultDecoder(self.layout, catalog, self.search.length_penalty)
        return CatalogVersion(name, self.catalogs.next_version(), catalog, host_trie, index,
                              decoder, source)  # fmt: skip

    def add_catalog(
        self, name: str, path: str | Path,
        before_swap: Callable[[CatalogVersion], object] | None = None,
    ) -> tuple[CatalogVersion, CatalogVersion | None]:  # fmt: skip
        """Load a catalog file as the new current version of `name` (built on this thread, the
        trie moved to the device by the engine thread on first use); returns (new, replaced).
        `before_swap(version)` runs before the swap (the server warms the new version's CUDA
        graphs there, while the old version keeps serving). Requests in flight keep the
        version they started with."""
        catalog = load_catalog(path, self.layout.level_sizes)
        if catalog.depth != self.trie.depth:
            raise CatalogError(
                f"catalog {path} has SIDs of depth {catalog.depth}; this engine serves depth "
                f"{self.trie.depth} (every catalog of a server has the model's SID depth)"
            )
        host = build_trie(catalog.codes, catalog.level_sizes, kind=self.search.trie_kind)
        version = self._new_version(name, catalog, host, CatalogIndex(catalog), str(path))
        if before_swap is not None:
            before_swap(version)
        return version, self.catalogs.put(version)

    @classmethod
    def from_config(
        cls,
        engine_config: EngineConfig,
        search: SearchConfig | None = None,
        registry: Registry | None = None,
        max_queue: int = 1024,
    ) -> Engine:
        from transformers import AutoTokenizer

        search = search or SearchConfig()
        # a clear error for a bad config.json before the tokenizer (transformers) reads it
        read_model_config(engine_config.model_path, engine_config.arch, registry)
        tokenizer = AutoTokenizer.from_pretrained(engine_config.model_path, local_files_only=True)
        catalog, layout = _load_layout_and_catalog(tokenizer, search)
        runner = ModelRunner.from_config(engine_config, registry, sid_depth=layout.depth)
        return cls(runner, tokenizer, layout, catalog, search, max_queue)

    @staticmethod
    def _create_trie(
        catalog: Catalog | None, layout: SidLayout, search: SearchConfig, device: torch.device
    ) -> Trie:
        if catalog is None:
            return UnconstrainedTrie(layout.level_sizes, device)
        return build_trie(catalog.codes, catalog.level_sizes, kind=search.trie_kind).to(device)

    def encode_prompt(
        self,
        prompt: str | None = None,
        messages: Sequence[dict[str, str]] | None = None,
        *,
        raw: bool = False,
    ) -> list[int]:
        """Token ids of a prompt: the chat template when the tokenizer has one (a bare prompt
        becomes one user message) unless `raw`, the text as is otherwise; then <|sid_begin|>
        when the layout has it. Empty or whitespace-only text is a ValueError."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt or messages")
        texts = [prompt] if prompt is not None else [m.get("content", "") for m in messages or ()]
        if not any(isinstance(t, str) and t.strip() for t in texts):
            # the chat template alone would still be a prompt, and rank items for nobody
            raise ValueError("the prompt is empty or only whitespace; send the user's history")
        if self.tokenizer.chat_template and not raw:
            msgs = list(messages) if messages is not None else [{"role": "user", "content": prompt}]
            text = self.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=True, tokenize=False
            )
        elif messages is not None:
            raise ValueError("the tokenizer has no chat template; send a plain prompt instead")
        else:
            text = prompt
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self.with_sid_begin(ids)

    def with_sid_begin(self, ids: Sequence[int]) -> list[int]:
        """Prompt token ids as the engine runs them: <|sid_begin|> appended when the layout
        has it (and `append_sid_begin` is on) and the prompt does not already end with it."""
        ids = list(ids)
        begin = self.layout.begin_token_id
        if self.search.append_sid_begin and begin is not None and (not ids or ids[-1] != begin):
            ids.append(begin)
        return ids

    @property
    def vocab_size(self) -> int:
        return self.runner.config.vocab_size

    def make_request(
        self,
        prompt: str | None = None,
        messages: Sequence[dict[str, str]] | None = None,
        n: int = 10,
        temperature: float = 0.0,
        seed: int | None = None,
        exclude_items: Sequence[str] = (),
        allow_items: Sequence[str] | None = None,
        filters: AttrFilters | None = None,
        catalog: str | None = None,
    ) -> GenerationRequest:
        ids = self.encode_prompt(prompt, messages)
        version = self.catalogs.get(catalog)
        item_filter = self.create_filter(exclude_items, allow_items, filters, version)
        return GenerationRequest(tuple(ids), n, temperature, seed, item_filter, version)

    def create_filter(
        self,
        exclude_items: Sequence[str] = (),
        allow_items: Sequence[str] | None = None,
        filters: AttrFilters | None = None,
        version: CatalogVersion | None = None,
    ) -> ItemFilter | None:
        """A request's item filter over `version` (default: the current default catalog), or
        None when it filters nothing; FilterError when it leaves no item, names an unknown
        attribute, or there is no catalog."""
        if not exclude_items and allow_items is None and not filters:
            return None
        index = (version or self.catalogs.get()).index
        if index is None:
            raise FilterError("item filters need a catalog (--catalog)", "exclude_items")
        return index.create_filter(exclude_items, allow_items, filters)

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


def _load_layout_and_catalog(
    tokenizer: Any, search: SearchConfig
) -> tuple[Catalog | None, SidLayout]:
    """Infer the SID layout from the tokenizer (and flags), then load the catalog against it."""
    vocab = tokenizer.get_vocab()
    full = infer_sid_layout(vocab, level_sizes=search.sid_level_sizes)
    if search.catalog_path is None:
        layout = (
            full
            if search.sid_depth is None
            else infer_sid_layout(vocab, level_sizes=search.sid_level_sizes, depth=search.sid_depth)
        )
        return None, layout
    catalog = load_catalog(search.catalog_path, full.level_sizes)
    full.check_catalog_depth(catalog.depth, search.sid_depth, f"catalog {search.catalog_path}")
    depth = search.sid_depth or catalog.depth
    if depth != catalog.depth:
        raise ValueError(
            f"--sid-depth {depth} disagrees with the catalog {search.catalog_path}, "
            f"whose SIDs have {catalog.depth} levels"
        )
    layout = infer_sid_layout(vocab, level_sizes=search.sid_level_sizes, depth=depth)
    logger.info("catalog: %d SIDs, %d items, depth %d", len(catalog), catalog.num_items, depth)
    return catalog, layout
