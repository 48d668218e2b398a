"""What an engine's clients need without its device: the tokenizer, the SID layout and the named
catalogs on the host. It turns prompts into requests and reads results.

`Engine` is a front with a model runner and a loop. The server's HTTP process, when the engine
runs in a process of its own (`server/engine_process.py`), holds a front alone: it tokenizes,
checks, binds catalog versions, builds item filters and shapes answers there, so none of that
Python runs beside the engine thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.catalogs import DEFAULT_CATALOG, CatalogSet, CatalogVersion
from flashrec_core.engine.requests import GenerationRequest, ResultDecoder
from flashrec_core.registry import Registry, read_model_config
from flashrec_core.search.catalog import Catalog, CatalogError
from flashrec_core.search.catalog_formats import load_catalog
from flashrec_core.search.filters import AttrFilters, CatalogIndex, FilterError, ItemFilter
from flashrec_core.search.sid_layout import SidLayout, infer_sid_layout
from flashrec_core.search.trie import Trie, build_trie
from flashrec_core.spec import ModelConfig

logger = logging.getLogger("flashrec")


class EngineFront:
    """Tokenizer + SID layout + named catalogs (host tries, filter indexes, result decoders)."""

    def __init__(
        self,
        tokenizer: Any,
        layout: SidLayout,
        catalog: Catalog | None,
        search: SearchConfig,
        host_trie: Trie,
        vocab_size: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.layout = layout
        self.search = search
        self.vocab_size = vocab_size
        self.sid_depth = host_trie.depth
        """Every catalog's SID depth (the startup catalog's, or the layout's without one)."""
        index = CatalogIndex(catalog) if catalog is not None else None
        self.catalogs = CatalogSet()
        """Named catalogs, each at its current version; requests bind one when made."""
        default = self._new_version(
            DEFAULT_CATALOG, catalog, host_trie, index, search.catalog_path or "<none>"
        )
        self.catalogs.put(default)
        self.decoder = default.decoder

    @classmethod
    def from_config(
        cls, engine_config: EngineConfig, search: SearchConfig | None = None,
        registry: Registry | None = None,
    ) -> EngineFront:  # fmt: skip
        """A front over the checkpoint's tokenizer and config and the search's catalog: no
        weights are read and no device is touched."""
        search = search or SearchConfig()
        config, tokenizer, layout, catalog = load_front_parts(engine_config, search, registry)
        if catalog is not None:
            trie = build_trie(catalog.codes, catalog.level_sizes, kind=search.trie_kind)
        else:
            trie = unconstrained_host_trie(layout)
        return cls(tokenizer, layout, catalog, search, trie, config.vocab_size)

    @property
    def catalog(self) -> Catalog | None:
        """The current default catalog."""
        return self.catalogs.get().catalog

    @property
    def catalog_index(self) -> CatalogIndex | None:
        return self.catalogs.get().index

    def _new_version(
        self, name: str, catalog: Catalog | None, host_trie: Trie, index: CatalogIndex | None,
        source: str, number: int | None = None,
    ) -> CatalogVersion:  # fmt: skip
        decoder = ResultDecoder(self.layout, catalog, self.search.length_penalty)
        number = self.catalogs.next_version() if number is None else number
        return CatalogVersion(name, number, catalog, host_trie, index, decoder, source)

    def load_catalog_version(
        self, name: str, path: str | Path, number: int | None = None
    ) -> CatalogVersion:
        """A catalog file as a new version of `name`, not yet served (`number`: the version
        another front of the same server gave it, so both name it alike)."""
        catalog = load_catalog(path, self.layout.level_sizes)
        if catalog.depth != self.sid_depth:
            raise CatalogError(
                f"catalog {path} has SIDs of depth {catalog.depth}; this engine serves depth "
                f"{self.sid_depth} (every catalog of a server has the model's SID depth)"
            )
        host = build_trie(catalog.codes, catalog.level_sizes, kind=self.search.trie_kind)
        return self._new_version(name, catalog, host, CatalogIndex(catalog), str(path), number)

    def add_catalog(
        self, name: str, path: str | Path,
        before_swap: Callable[[CatalogVersion], object] | None = None,
    ) -> tuple[CatalogVersion, CatalogVersion | None]:  # fmt: skip
        """Load a catalog file as the new current version of `name` (built on this thread, the
        trie moved to the device by the engine thread on first use); returns (new, replaced).
        `before_swap(version)` runs before the swap (the server warms the new version's CUDA
        graphs there, while the old version keeps serving). Requests in flight keep the
        version they started with."""
        version = self.load_catalog_version(name, path)
        if before_swap is not None:
            before_swap(version)
        return version, self.catalogs.put(version)

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


def load_front_parts(
    engine_config: EngineConfig, search: SearchConfig, registry: Registry | None = None
) -> tuple[ModelConfig, Any, SidLayout, Catalog | None]:
    """The checkpoint's parsed config and tokenizer, the SID layout inferred from the tokenizer,
    and the search's catalog."""
    from transformers import AutoTokenizer

    # a clear error for a bad config.json before the tokenizer (transformers) reads it
    config = read_model_config(engine_config.model_path, engine_config.arch, registry)[1]
    tokenizer = AutoTokenizer.from_pretrained(engine_config.model_path, local_files_only=True)
    catalog, layout = _load_layout_and_catalog(tokenizer, search)
    return config, tokenizer, layout, catalog


def unconstrained_host_trie(layout: SidLayout) -> Trie:
    """The trie of a search without a catalog (every code combination), on the host."""
    import torch

    from flashrec_core.search.unconstrained import UnconstrainedTrie

    return UnconstrainedTrie(layout.level_sizes, torch.device("cpu"))


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
