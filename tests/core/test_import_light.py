"""The core stays light (no torch to list plugins) and knows no model family by name."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "triton", "flashinfer", "transformers")

LIGHT_SCRIPT = """
import json, sys
import flashrec_core.spec, flashrec_core.registry, flashrec_core.fused
from flashrec_core.registry import Registry

reg = Registry.discover()
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})
print(json.dumps({{"heavy": heavy, "archs": reg.architectures()}}))
"""

FAMILIES = ("qwen", "llama", "phi", "mistral", "gemma")
_LOWER = "|".join(FAMILIES)
_TITLE = "|".join(f.title() for f in FAMILIES) + "|" + "|".join(f.upper() for f in FAMILIES)
# lower-case names start a word (qwen3, flashrec_models_qwen3, "phi"); title/upper-case names may
# also start a CamelCase part (TestQwen3, PhiForCausalLM). Neither may run on into lower-case
# letters, so "philox" or "lexicographic" do not match.
FAMILY_RE = re.compile(rf"(?<![A-Za-z])(?:{_LOWER})(?![a-z])|(?:{_TITLE})(?![a-z])")
ALLOWED = re.compile(r"llama3(?![A-Za-z0-9])")
"""`llama3` is a RoPE scaling type: the value transformers writes in config.json's
rope_scaling.rope_type, which the core must parse (like "yarn"); it names a method, not a model."""


def _family_names() -> list[str]:
    found = []
    for folder in ("flashrec_core", "flashrec_kernels"):
        assert (ROOT / folder / "__init__.py").is_file(), f"no package {folder} to scan"
        for path in sorted((ROOT / folder).rglob("*.py")):
            for lineno, line in enumerate(path.read_text().splitlines(), 1):
                for m in FAMILY_RE.finditer(line):
                    if ALLOWED.match(line, m.start()):
                        continue
                    found.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    return found


def test_spec_and_registry_import_without_torch() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", LIGHT_SCRIPT.format(heavy=set(HEAVY))],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "Qwen3ForCausalLM" in out["archs"], "discovery loaded the installed plugin"
    assert out["heavy"] == [], f"listing plugins imported {out['heavy']}"


def test_family_regex_matches_what_it_should() -> None:
    hits = ["Qwen3ForCausalLM", "flashrec_models_qwen3", "TestQwen3", "PhiForCausalLM",
            "LlamaConfig", "if 'mistral' in x", "GEMMA", "phi3"]  # fmt: skip
    misses = ["lexicographic", "philox", "graphics", "stemma", "mistrals", "rope_type llama3"]
    assert all(FAMILY_RE.search(s) for s in hits), [s for s in hits if not FAMILY_RE.search(s)]
    for s in misses:
        assert not any(not ALLOWED.match(s, m.start()) for m in FAMILY_RE.finditer(s)), s


def test_core_names_no_model_family() -> None:
    found = _family_names()
    assert not found, "the core names model families:\n" + "\n".join(found)


def test_the_load_generator_imports_no_torch() -> None:
    """`flashrec bench --server` spawns one client process per 32 concurrent requests; each
    imports `flashrec_core.bench.load`, which must not drag torch in (2 s and ~300 MB each)."""
    script = (
        "import json, sys; import flashrec_core.bench.load; "
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []
