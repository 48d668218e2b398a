"""The offline engine: load a GenRec checkpoint once, then `generate` ranked items many times.

engine = Engine.from_config(EngineConfig(model_path=DIR), SearchConfig(catalog_path=FILE))
[result] = engine.generate([engine.make_request(prompt="user history w1 w2", n=10)])
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from flashrec_core.config import EngineConfig, SearchConfig
from flashrec_core.engine.beam_wave import BeamWave, WaveOutput
from flashrec_core.engine.model_runner import ModelRunner
from flashrec_core.engine.requests import Choice, GenerationRequest, GenerationResult
from flashrec_core.engine.scheduler import plan_waves
from flashrec_core.registry import Registry, load_hf_config
from flashrec_core.search.catalog import Catalog
from flashrec_core.search.catalog_formats import load_catalog
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
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.layout = layout
        self.catalog = catalog
        self.search = search
        self.trie = self._create_trie(catalog, layout, search, runner.device)
        head = RestrictedLMHead(
            runner.lm_head(), runner.lm_head_bias(), layout, search.sid_normalization
        )
        self.wave = BeamWave(runner, head, self.trie, layout)

    @classmethod
    def from_config(
        cls,
        engine_config: EngineConfig,
        search: SearchConfig | None = None,
        registry: Registry | None = None,
    ) -> Engine:
        from transformers import AutoTokenizer

        search = search or SearchConfig()
        load_hf_config(engine_config.model_path)  # a clear error before the tokenizer's
        tokenizer = AutoTokenizer.from_pretrained(engine_config.model_path, local_files_only=True)
        catalog, layout = _load_layout_and_catalog(tokenizer, search)
        runner = ModelRunner.from_config(engine_config, registry)
        return cls(runner, tokenizer, layout, catalog, search)

    @staticmethod
    def _create_trie(
        catalog: Catalog | None, layout: SidLayout, search: SearchConfig, device: torch.device
    ) -> Trie:
        if catalog is None:
            return UnconstrainedTrie(layout.level_sizes, device)
        return build_trie(catalog.codes, catalog.level_sizes, kind=search.trie_kind).to(device)

    def encode_prompt(
        self, prompt: str | None = None, messages: Sequence[dict[str, str]] | None = None
    ) -> list[int]:
        """Token ids of a prompt: the chat template when the tokenizer has one (a bare prompt
        becomes one user message), raw text otherwise; then <|sid_begin|> when the layout has it."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.tokenizer.chat_template:
            msgs = list(messages) if messages is not None else [{"role": "user", "content": prompt}]
            text = self.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=True, tokenize=False
            )
        elif messages is not None:
            raise ValueError("the tokenizer has no chat template; send a plain prompt instead")
        else:
            text = prompt
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if self.search.append_sid_begin and self.layout.begin_token_id is not None:
            ids.append(self.layout.begin_token_id)
        return ids

    def make_request(
        self,
        prompt: str | None = None,
        messages: Sequence[dict[str, str]] | None = None,
        n: int = 10,
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> GenerationRequest:
        ids = self.encode_prompt(prompt, messages)
        return GenerationRequest(tuple(ids), n, temperature, seed)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Run beam search for every request, packed into waves that share each forward step;
        results come back in request order."""
        if not requests:
            return []
        limit = self.runner.config.max_position
        for req in requests:
            if len(req.prompt_ids) + self.trie.depth > limit:
                raise ValueError(
                    f"prompt of {len(req.prompt_ids)} tokens + {self.trie.depth} SID tokens "
                    f"exceeds the model's max_position_embeddings {limit}"
                )
        runner = self.runner
        waves = plan_waves(
            requests, depth=self.trie.depth, max_rows=runner.loaded.engine_config.max_wave_rows,
            max_requests=len(runner.request_table.lengths), kv_slots=runner.allocator.num_slots - 1,
        )  # fmt: skip
        results: list[GenerationResult] = []
        for wave in waves:
            batch = [requests[i] for i in wave]
            results.extend(self._results(batch, self.wave.run(batch)))
        return results

    def _results(
        self, requests: list[GenerationRequest], out: WaveOutput
    ) -> list[GenerationResult]:
        codes, scores, nodes = out.codes.cpu(), out.scores.cpu(), out.nodes.cpu()
        offsets = out.layout.row_offsets.cpu().tolist()
        depth = self.trie.depth
        results = []
        for req, start in zip(requests, offsets):
            rows = sorted(
                (r for r in range(start, start + req.n) if scores[r] > float("-inf")),
                key=lambda r: (-scores[r].item(), r),
            )
            choices = [
                self._choice(i, codes[r], scores[r].item(), int(nodes[r]))
                for i, r in enumerate(rows)
            ]
            notes = []
            if len(choices) < req.n:
                notes.append(f"only {len(choices)} valid items reachable; requested n={req.n}")
            results.append(
                GenerationResult(choices, len(req.prompt_ids), depth * len(choices), req.n, notes)
            )
        return results

    def _choice(self, index: int, codes: torch.Tensor, logprob: float, node: int) -> Choice:
        code_list = tuple(int(c) for c in codes.tolist())
        token_ids = tuple(self.layout.token_id(lv, c) for lv, c in enumerate(code_list))
        items = self.catalog.items[node] if self.catalog is not None else ()
        score = logprob / (len(code_list) ** self.search.length_penalty)
        return Choice(
            index, code_list, token_ids, self.layout.format(code_list), items, logprob, score
        )


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
    full.check_catalog_depth(catalog.depth)
    depth = search.sid_depth or catalog.depth
    if depth != catalog.depth:
        raise ValueError(
            f"--sid-depth {depth} disagrees with the catalog {search.catalog_path}, "
            f"whose SIDs have {catalog.depth} levels"
        )
    layout = infer_sid_layout(vocab, level_sizes=search.sid_level_sizes, depth=depth)
    logger.info("catalog: %d SIDs, %d items, depth %d", len(catalog), catalog.num_items, depth)
    return catalog, layout
