"""Where semantic-ID tokens live in the vocabulary, inferred from the tokenizer's added tokens."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

_SID_TOKEN = re.compile(r"<s_([a-z])_(\d+)>")


@functools.lru_cache(maxsize=64)
def _code_texts(name: str, size: int) -> tuple[str, ...]:
    """The text of every code of one level: "<s_a_0>", "<s_a_1>", ..."""
    return tuple(f"<s_{name}_{c}>" for c in range(size))


class SidLayoutError(ValueError):
    """The tokenizer's SID tokens, the explicit SID flags, or a catalog do not agree."""


@dataclass(frozen=True)
class SidLayout:
    """Token ids of the SID codebook levels; level `l` code `c` is token `level_starts[l] + c`.

    Levels are back to back in the vocabulary, so `[sid_start, sid_end)` covers every SID token
    (the restricted LM head slices exactly that range).
    """

    level_names: tuple[str, ...]
    level_starts: tuple[int, ...]
    level_sizes: tuple[int, ...]
    begin_token_id: int | None = None
    end_token_id: int | None = None

    def __post_init__(self) -> None:
        n = len(self.level_names)
        if n == 0 or len(self.level_starts) != n or len(self.level_sizes) != n:
            raise SidLayoutError(
                f"SidLayout needs one name, start and size per level; got {n} names, "
                f"{len(self.level_starts)} starts, {len(self.level_sizes)} sizes"
            )
        if any(k <= 0 for k in self.level_sizes):
            raise SidLayoutError(f"SID level sizes must be positive, got {self.level_sizes}")
        for lvl in range(1, n):
            expected = self.level_starts[lvl - 1] + self.level_sizes[lvl - 1]
            if self.level_starts[lvl] != expected:
                raise SidLayoutError(
                    f"SID level {self.level_names[lvl]!r} starts at token id "
                    f"{self.level_starts[lvl]}, expected {expected} (levels must be back to back)"
                )

    @property
    def depth(self) -> int:
        return len(self.level_sizes)

    @property
    def sid_start(self) -> int:
        """Token id of code 0 at the first level."""
        return self.level_starts[0]

    @property
    def sid_end(self) -> int:
        """Exclusive end of the last level's token ids."""
        return self.level_starts[-1] + self.level_sizes[-1]

    def token_id(self, level: int, code: int) -> int:
        if not 0 <= level < self.depth:
            raise SidLayoutError(f"SID level {level} out of range; this layout has {self.depth}")
        if not 0 <= code < self.level_sizes[level]:
            raise SidLayoutError(
                f"code {code} out of range for SID level {self.level_names[level]!r}; "
                f"expected 0..{self.level_sizes[level] - 1}"
            )
        return self.level_starts[level] + code

    def decode(self, token_ids: Iterable[int]) -> tuple[int, ...]:
        """Token ids of one SID (boundary tokens optional) -> codes, one per level."""
        ids = [int(t) for t in token_ids]
        if ids and self.begin_token_id is not None and ids[0] == self.begin_token_id:
            ids = ids[1:]
        if ids and self.end_token_id is not None and ids[-1] == self.end_token_id:
            ids = ids[:-1]
        if len(ids) != self.depth:
            raise SidLayoutError(
                f"cannot decode {len(ids)} SID tokens {ids}; this layout has depth {self.depth}"
            )
        codes = []
        for lvl, tok in enumerate(ids):
            code = tok - self.level_starts[lvl]
            if not 0 <= code < self.level_sizes[lvl]:
                lo, hi = self.level_starts[lvl], self.level_starts[lvl] + self.level_sizes[lvl]
                raise SidLayoutError(
                    f"token id {tok} at position {lvl} is not a level-{self.level_names[lvl]!r} "
                    f"SID token; expected an id in [{lo}, {hi})"
                )
            codes.append(code)
        return tuple(codes)

    def format(self, codes: Sequence[int]) -> str:
        """Codes (a full SID or a prefix) -> readable text such as "<s_a_12><s_b_4071>"."""
        if len(codes) > self.depth:
            raise SidLayoutError(f"{len(codes)} codes given; this layout has depth {self.depth}")
        return "".join(f"<s_{self.level_names[lvl]}_{int(c)}>" for lvl, c in enumerate(codes))

    def format_rows(self, codes: Sequence[Sequence[int]]) -> list[str]:
        """`format` of every row (full SIDs or prefixes of one length): each level's code texts
        are made once per layout, so a row costs one join (a 512-choice response formats 512)."""
        if not codes:
            return []
        if len(codes[0]) > self.depth:
            raise SidLayoutError(f"{len(codes[0])} codes given; this layout has depth {self.depth}")
        columns = []
        for lvl, column in enumerate(zip(*codes)):
            texts = _code_texts(self.level_names[lvl], self.level_sizes[lvl])
            columns.append([texts[c] for c in column])
        return ["".join(parts) for parts in zip(*columns)]

    def check_catalog_depth(
        self, depth: int, sid_depth: int | None = None, source: str = "the catalog"
    ) -> None:
        """Fail early when a catalog needs more levels than the tokenizer provides, or has fewer
        levels without `sid_depth` saying so (a row missing a code looks just like that)."""
        if depth > self.depth:
            raise SidLayoutError(
                f"{source} has SIDs of depth {depth} but the SID layout has only {self.depth} "
                f"levels ({', '.join(self.level_names)}); use a tokenizer with <s_x_N> tokens "
                f"for {depth} levels or a catalog of depth {self.depth}"
            )
        if depth < self.depth and sid_depth is None:
            raise SidLayoutError(
                f"{source} has SIDs of depth {depth} but the tokenizer has {self.depth} SID levels "
                f"({', '.join(self.level_names)}); add the missing codes to the catalog, or pass "
                f"--sid-depth {depth} to search the first {depth} levels only"
            )


def _scan_levels(vocab: Mapping[str, int]) -> dict[str, dict[int, int]]:
    """Level name -> {code: token id} for every `<s_x_N>` token in the vocabulary."""
    levels: dict[str, dict[int, int]] = {}
    for token, tid in vocab.items():
        m = _SID_TOKEN.fullmatch(token)
        if m is None:
            continue
        codes = levels.setdefault(m.group(1), {})
        code = int(m.group(2))
        if code in codes:
            raise SidLayoutError(
                f"the tokenizer has two tokens for level {m.group(1)!r} code {code} "
                f"(ids {codes[code]} and {tid}); each code needs exactly one token"
            )
        codes[code] = int(tid)
    return levels


def _check_level(name: str, codes: dict[int, int]) -> tuple[int, int]:
    """Check one level's codes are 0..K-1 with contiguous ids; return (start id, K)."""
    size = len(codes)
    for code in range(size):
        if code not in codes:
            raise SidLayoutError(
                f"the tokenizer's SID level {name!r} lacks code {code} (<s_{name}_{code}>); it "
                f"has {size} tokens up to <s_{name}_{max(codes)}>, expected codes 0..{size - 1}"
            )
    start = codes[0]
    for code in range(size):
        if codes[code] != start + code:
            raise SidLayoutError(
                f"token <s_{name}_{code}> has id {codes[code]}, expected {start + code}: the ids "
                f"of SID level {name!r} must be contiguous from <s_{name}_0> (id {start})"
            )
    return start, size


def _tokenizer_levels(vocab: Mapping[str, int]) -> list[tuple[str, int, int]]:
    """(name, start id, size) per level in the tokenizer, checked for gaps and order."""
    found = _scan_levels(vocab)
    if not found:
        raise SidLayoutError(
            "the tokenizer has no SID tokens; expected added tokens <s_a_0>, <s_a_1>, ..., "
            "<s_b_0>, ... (one letter per codebook level); use the GenRec model's tokenizer"
        )
    names = [chr(ord("a") + i) for i in range(len(found))]
    if sorted(found) != names:
        missing = sorted(set(names) - set(found))
        raise SidLayoutError(
            f"the tokenizer has SID levels {sorted(found)} but levels must be consecutive "
            f"letters from 'a'; missing level(s) {missing}"
        )
    levels = [(name, *_check_level(name, found[name])) for name in names]
    for (prev, p_start, p_size), (name, start, _) in pairwise(levels):
        if start != p_start + p_size:
            raise SidLayoutError(
                f"<s_{name}_0> has id {start}, expected {p_start + p_size} right after "
                f"<s_{prev}_{p_size - 1}>: SID levels must be back to back in order a, b, c, ..."
            )
    return levels


def _resolve_depth(
    tok_sizes: list[int], level_sizes: Sequence[int] | None, depth: int | None
) -> int:
    """How many tokenizer levels to use; overrides must agree with the tokenizer."""
    have = ",".join(map(str, tok_sizes))
    if level_sizes is not None and depth is not None and len(level_sizes) != depth:
        raise SidLayoutError(
            f"--sid-level-sizes lists {len(level_sizes)} levels but --sid-depth is {depth}; "
            f"pass one size per level or drop one of the two flags"
        )
    use = depth if depth is not None else len(level_sizes or tok_sizes)
    if not 1 <= use <= len(tok_sizes):
        raise SidLayoutError(
            f"SID depth {use} asked for, but the tokenizer has {len(tok_sizes)} SID levels "
            f"(sizes {have}); pass a depth between 1 and {len(tok_sizes)}"
        )
    for lvl, size in enumerate(level_sizes or ()):
        if int(size) != tok_sizes[lvl]:
            name = chr(ord("a") + lvl)
            raise SidLayoutError(
                f"--sid-level-sizes gives {size} codes for level {name!r} but the tokenizer has "
                f"{tok_sizes[lvl]} (<s_{name}_0>..<s_{name}_{tok_sizes[lvl] - 1}>); pass "
                f"--sid-level-sizes {','.join(map(str, tok_sizes[:use]))} or omit it"
            )
    return use


def infer_sid_layout(
    vocab: Mapping[str, int],
    *,
    level_sizes: Sequence[int] | None = None,
    depth: int | None = None,
    begin_token: str | None = "<|sid_begin|>",
    end_token: str | None = "<|sid_end|>",
) -> SidLayout:
    """Infer the SID layout from a tokenizer vocabulary (`tokenizer.get_vocab()`).

    `level_sizes` and `depth` are explicit overrides: they may select the first levels but must
    agree with the tokenizer. Boundary tokens are optional; absent ones give None.
    """
    levels = _tokenizer_levels(vocab)
    use = _resolve_depth([size for _, _, size in levels], level_sizes, depth)
    return SidLayout(
        level_names=tuple(name for name, _, _ in levels[:use]),
        level_starts=tuple(start for _, start, _ in levels[:use]),
        level_sizes=tuple(size for _, _, size in levels[:use]),
        begin_token_id=vocab.get(begin_token) if begin_token is not None else None,
        end_token_id=vocab.get(end_token) if end_token is not None else None,
    )
