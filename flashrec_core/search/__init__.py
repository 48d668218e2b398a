"""SID layout, catalogs, the catalog trie, the restricted LM head and beam selection."""

from flashrec_core.search.beam import (
    BeamLayout,
    Selection,
    expand_beams,
    select_from_rows,
)
from flashrec_core.search.catalog import Catalog, CatalogError, build_catalog
from flashrec_core.search.catalog_formats import convert_packed_catalog, load_catalog
from flashrec_core.search.lm_head import Normalization, RestrictedLMHead
from flashrec_core.search.sid_layout import SidLayout, SidLayoutError, infer_sid_layout
from flashrec_core.search.trie import CsrTrie, DenseTrie, Trie, TrieChildren, TrieError, build_trie
from flashrec_core.search.unconstrained import UnconstrainedTrie

__all__ = [
    "BeamLayout",
    "Catalog",
    "CatalogError",
    "CsrTrie",
    "DenseTrie",
    "Normalization",
    "RestrictedLMHead",
    "Selection",
    "SidLayout",
    "SidLayoutError",
    "Trie",
    "TrieChildren",
    "TrieError",
    "UnconstrainedTrie",
    "build_catalog",
    "build_trie",
    "convert_packed_catalog",
    "expand_beams",
    "infer_sid_layout",
    "load_catalog",
    "select_from_rows",
]
