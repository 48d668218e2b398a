"""Why the published reference engine (PyPI flashrec 0.1.2) returns SIDs outside its catalog:
a CPU reproduction with its own trie and beam-search functions (docs/benchmarks.md).

Usage (the reference installed into its own directory, as scripts/gpu_run.sh `compare` does):
  pip install --target /tmp/refsite --no-deps .whl/ref/flashrec-0.1.2-py3-none-any.whl
  PYTHONPATH=/tmp/refsite python3 scripts/reference_shortlist_repro.py \
      [--sids 1000000] [--size 8192] [--widths 50,512] [--requests 20] [--dense]

1. builds a random catalog of unique triples, writes it with OUR script's
   write_reference_catalog (scripts/compare_reference.py) and builds the
   reference trie with the same arguments BeamRecEngine passes
   (build_beam_valid_path(sid_file, codebook_sizes, special_token_ids=range)).
2. checks the trie: for sampled level-2 / level-3 prefixes, mask_candidates over
   the FULL level vocabulary must allow exactly the catalog children.
3. runs the reference's own beam-search functions (init_from_prefill,
   expand_step, select_final_topk via will_finish) the way its scheduler does
   (narrow to the level, per-beam top-(2*bw) = BeamRequest.beam_candidates,
   then mask), with random log-probs, and counts final SIDs not in the catalog;
   then the same with candidates = the full level (8192).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ap = argparse.ArgumentParser()
ap.add_argument("--sids", type=int, default=1_000_000)
ap.add_argument("--size", type=int, default=8192)
ap.add_argument("--widths", default="50,512")
ap.add_argument("--requests", type=int, default=20)
ap.add_argument("--dense", action="store_true", help="force the dense allow_table")
args = ap.parse_args()

import flashrec.search.trie as T  # noqa: E402
from flashrec.search.expand import expand_step, init_from_prefill  # noqa: E402

if args.dense:
    T._DENSE_MAX_CELLS = 1 << 62

# our script's catalog writer (load the module without running main)
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
spec = importlib.util.spec_from_file_location("compare_reference", HERE / "compare_reference.py")
cr = importlib.util.module_from_spec(spec)
sys.modules["compare_reference"] = cr
spec.loader.exec_module(cr)

S, N, L = args.size, args.sids, 3
BASE = 151669  # any token base; the reference takes special_token_ids[0]
rng = np.random.default_rng(0)
packed = np.unique(rng.integers(0, S**3, size=int(N * 1.01), dtype=np.int64))[:N]
rng.shuffle(packed)
codes = np.stack([packed // S**2, (packed // S) % S, packed % S], axis=1)
catalog = set(map(tuple, codes.tolist()))
print(f"catalog: {len(catalog)} unique SIDs, {L} levels x {S}")

tmp = Path(tempfile.mkdtemp())
path = tmp / "sid2vid_reference.json"
cr.write_reference_catalog(codes, path)  # exactly what compare_reference.py writes
t0 = time.time()
trie = T.build_beam_valid_path(
    sid_file=str(path),
    codebook_sizes=[S] * L,
    special_token_ids=list(range(BASE, BASE + L * S)),  # sid_token_range start:end-1
)
trie._ensure_gpu_cache(torch.device("cpu"))
print(
    f"trie mode={trie.mode} max_depth={trie.max_depth} token_base={trie.token_base} "
    f"vocab={trie.vocab_size} nodes={len(trie._prefix_to_node)} "
    f"dense={trie._allow_table is not None} csr={trie._csr_keys is not None} "
    f"({time.time() - t0:.1f}s)"
)


def tok(level, c):
    return BASE + level * S + int(c)


# --- 2. trie correctness over the full level vocabulary ----------------------------------
children = {}
for a, b, c in catalog:
    children.setdefault((a,), set()).add(b)
    children.setdefault((a, b), set()).add(c)
prefixes2 = [p for p in children if len(p) == 1]
prefixes3 = [p for p in children if len(p) == 2]
sample2 = [prefixes2[i] for i in rng.choice(len(prefixes2), 200, replace=False)]
sample3 = [prefixes3[i] for i in rng.choice(len(prefixes3), 2000, replace=False)]
# also prefixes NOT in the catalog (must allow nothing)
bad3 = []
while len(bad3) < 200:
    p = (int(rng.integers(S)), int(rng.integers(S)))
    if p not in children:
        bad3.append(p)
mismatch = 0
for level, sample in ((1, sample2), (2, sample3), (2, bad3)):
    pref = torch.tensor([[tok(i, c) for i, c in enumerate(p)] for p in sample])
    nodes = trie.bootstrap_node_ids(pref, len(sample), level, torch.device("cpu"))
    cand = torch.arange(S).unsqueeze(0).expand(len(sample), S) + BASE + level * S
    sc = trie.mask_candidates(pref, cand, torch.zeros(cand.shape), level, node_ids=nodes)
    for p, row in zip(sample, sc):
        got = set(torch.nonzero(torch.isfinite(row)).view(-1).tolist())
        if got != children.get(p, set()):
            mismatch += 1
print(
    f"trie check: {len(sample2)} level-2 + {len(sample3)} level-3 catalog prefixes + "
    f"{len(bad3)} non-catalog level-3 prefixes, allowed-set mismatches = {mismatch}"
)
# incremental node advance (what expand_step uses) vs bootstrap
p = sample3[:50]
n1 = trie.bootstrap_node_ids(torch.tensor([[tok(0, a)] for a, _ in p]), 50, 1, torch.device("cpu"))
n2 = trie.advance_node_ids(n1, torch.arange(50), torch.tensor([tok(1, b) for _, b in p]))
n2b = trie.bootstrap_node_ids(
    torch.tensor([[tok(0, a), tok(1, b)] for a, b in p]), 50, 2, torch.device("cpu")
)
print(f"advance_node_ids == bootstrap walk: {bool(torch.equal(n2, n2b))}")
kids = [len(children[q]) for q in prefixes3]
print(
    f"children per catalog level-2 prefix: mean {np.mean(kids):.3f}; "
    f"per level-1 prefix: mean {np.mean([len(children[q]) for q in prefixes2]):.1f}"
)


# --- 3. the reference's beam search (its scheduler's eager/CSR path) -----------------------
def level_ids(level):
    return torch.arange(S, dtype=torch.int64) + BASE + level * S


def run_request(bw, cand, g):
    """One request, random per-beam log-probs per level, as scheduler._expand_decode_body."""
    lp0 = torch.log_softmax(torch.randn(S, generator=g), 0)
    bl = init_from_prefill(lp0, bw, cand, L, 10, valid_path=trie, candidate_token_ids=level_ids(0))
    for level in (1, 2):
        row = torch.log_softmax(torch.randn(bw, S, generator=g), 1)  # narrowed to the level
        k = min(cand, S)
        vals, idx = torch.topk(row, k, dim=1, largest=True, sorted=True)
        tokens = level_ids(level)[idx]
        expand_step(
            bl,
            tokens,
            vals,
            beam_width=bw,
            valid_path=trie,
            ignore_eos=True,
            will_finish=(level == L - 1),
        )
    sids = []
    for r in bl.token_ids[:bw].tolist():
        sids.append(tuple(t - BASE - i * S for i, t in enumerate(r[:L])))
    neg = int(torch.isinf(bl.cum_logprobs).sum())
    return sids, neg


for bw in [int(x) for x in args.widths.split(",")]:
    for cand, label in ((2 * bw, "reference default beam_candidates=2*bw"), (S, "full level")):
        g = torch.Generator().manual_seed(1)
        tot = bad = neg = bad2 = 0
        t0 = time.time()
        for _ in range(args.requests):
            sids, ninf = run_request(bw, cand, g)
            tot += len(sids)
            bad += sum(s not in catalog for s in sids)
            bad2 += sum(s[:2] not in children for s in sids)
            neg += ninf
        exp = 1 - min(1.0, cand * np.mean(kids) / S)
        print(
            f"n={bw} candidates={cand} ({label}): {bad}/{tot} = {bad / tot:.1%} SIDs not in "
            f"catalog (level-2 prefix invalid {bad2 / tot:.1%}, final score -inf {neg / tot:.1%}; "
            f"~1-cand*E[children]/S = {exp:.1%}) [{time.time() - t0:.1f}s]"
        )
