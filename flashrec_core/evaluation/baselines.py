"""Non-neural baselines fitted on the same training sequences as the model.

- popularity: the most frequent training items, the same list for everyone;
- item-to-item co-occurrence: items that directly followed the history's last item in training
  sequences, most frequent first ("users who ordered this next ordered ..."), topped up with
  popular items when the last item has fewer successors (or none).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from flashrec_core.evaluation.metrics import Answer


class PopularityBaseline:
    name = "popularity"

    def __init__(self, train: Mapping[str, Sequence[str]]) -> None:
        counts = Counter(item for seq in train.values() for item in seq)
        # ties by item id, so the ranking does not depend on the log's row order
        self.ranking = [item for item, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]

    def recommend(self, history: Sequence[str], n: int) -> list[Answer]:
        return [(item,) for item in self.ranking[:n]]


class CooccurrenceBaseline:
    name = "cooccurrence"

    def __init__(self, train: Mapping[str, Sequence[str]]) -> None:
        self.popular = PopularityBaseline(train)
        follows: dict[str, Counter[str]] = {}
        for seq in train.values():
            for a, b in zip(seq[:-1], seq[1:]):
                follows.setdefault(a, Counter())[b] += 1
        self.next = {
            a: [b for b, _ in sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))]
            for a, c in follows.items()
        }

    def recommend(self, history: Sequence[str], n: int) -> list[Answer]:
        ranked = list(self.next.get(history[-1], [])[:n]) if history else []
        seen = set(ranked)
        ranked += [i for i in self.popular.ranking if i not in seen][: n - len(ranked)]
        return [(item,) for item in ranked]
