"""A plugin written outside this repository works with no change to the core.

The test writes a throwaway distribution (own pyproject and entry point) into a temp dir,
pip-installs it into the running environment, checks that `flashrec models` lists it and that
`flashrec generate --arch ToyForCausalLM` runs it, then uninstalls it and checks it is gone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "flashrec-models-toy"
version = "0.0.1"
dependencies = ["flashrec-core"]

[project.entry-points."flashrec.models"]
ToyForCausalLM = "flashrec_models_toy:spec"
"""

# A compact model of Qwen3's structure under a new architecture name, built only from
# flashrec_core.layers: the checkpoint is a transformers Qwen3 one, loaded with --arch.
PLUGIN = """
from torch import nn
from flashrec_core.layers import (Attention, Embedding, Linear, RMSNorm, RotaryEmbedding,
                                  SiluAndMul, split_qkv)
from flashrec_core.hf_config import parse_rope, require_field
from flashrec_core.spec import BaseModelSpec, Bucket, ExampleConfig, ModelConfig, WeightMap


def parse(hf):
    get = lambda k, t=int: require_field(hf, k, "ToyForCausalLM", t)
    return ModelConfig(
        architecture="ToyForCausalLM", vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
        num_layers=get("num_hidden_layers"), num_q_heads=get("num_attention_heads"),
        num_kv_heads=get("num_key_value_heads"), head_dim=get("head_dim"),
        intermediate_size=get("intermediate_size"), max_position=get("max_position_embeddings"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings")), norm_eps=get("rms_norm_eps", float),
        rope=parse_rope(hf, get("head_dim"), "ToyForCausalLM"),
    )


class Layer(nn.Module):
    def __init__(self, c, i, ctx):
        super().__init__()
        q, kv = c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.c, self.i = c, i
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps, ctx)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.norm_eps, ctx)
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = Linear(c.hidden_size, (q, kv, kv), bias=False, ctx=ctx)
        self.self_attn.o_proj = Linear(q, c.hidden_size, bias=False, ctx=ctx)
        self.self_attn.q_norm = RMSNorm(c.head_dim, c.norm_eps, ctx)
        self.self_attn.k_norm = RMSNorm(c.head_dim, c.norm_eps, ctx)
        self.attn = Attention(c.num_q_heads, c.num_kv_heads, c.head_dim, i, c.head_dim ** -0.5)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = Linear(c.hidden_size, (c.intermediate_size,) * 2, bias=False, ctx=ctx)
        self.mlp.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=False, ctx=ctx)
        self.act = SiluAndMul(quantize_output=ctx.fp8_linear)

    def forward(self, h, res, rotary, batch):
        a = self.self_attn
        x, res = self.input_layernorm(h, res)
        q, k, v = split_qkv(a.qkv_proj(x), self.c.num_q_heads, self.c.num_kv_heads, self.c.head_dim)
        q, k, stored = rotary(q, k, v, batch, self.i, a.q_norm, a.k_norm)
        h = a.o_proj(self.attn.forward(q, k, v, self.i, batch, skip_store=stored))
        x, res = self.post_attention_layernorm(h, res)
        return self.mlp.down_proj(self.act(self.mlp.gate_up_proj(x))), res


class ToyForCausalLM(nn.Module):
    def __init__(self, c, ctx):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = Embedding(c.vocab_size, c.hidden_size, ctx)
        self.model.layers = nn.ModuleList(Layer(c, i, ctx) for i in range(c.num_layers))
        self.model.norm = RMSNorm(c.hidden_size, c.norm_eps, ctx)
        self.rotary = RotaryEmbedding(c.rope, c.max_position, ctx)

    def forward(self, batch):
        h, res = self.model.embed_tokens(batch.input_ids), None
        for layer in self.model.layers:
            h, res = layer(h, res, self.rotary, batch)
        return self.model.norm(h, res)[0]

    def lm_head(self):
        return self.model.embed_tokens.weight


spec = BaseModelSpec(
    name="toy", architectures=("ToyForCausalLM",), config_parser=parse,
    weight_map=WeightMap(
        buckets=(Bucket("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                 Bucket("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))),
        tied=(("lm_head.weight", "model.embed_tokens.weight"),),
    ),
    model_class="flashrec_models_toy:ToyForCausalLM", hf_config_class="transformers:Qwen3Config",
    examples=(ExampleConfig("tiny", {}),),
)
"""

TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}  # fmt: skip


def _flashrec(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "flashrec_core.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _pip(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _listed() -> dict[str, str]:
    proc = _flashrec("models", "--json")
    assert proc.returncode == 0, proc.stderr
    return {a: p["distribution"] for p in json.loads(proc.stdout) for a in p["architectures"]}


@pytest.mark.slow
def test_third_party_plugin_installs_runs_and_uninstalls(tmp_path: Path) -> None:
    from flashrec_core.testing.checkpoint import write_tiny_checkpoint

    pkg = tmp_path / "flashrec-models-toy"
    (pkg / "flashrec_models_toy").mkdir(parents=True)
    (pkg / "pyproject.toml").write_text(PYPROJECT)
    (pkg / "flashrec_models_toy" / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    ckpt = tmp_path / "ckpt"
    write_tiny_checkpoint(ckpt, TINY_QWEN3, level_sizes=(8, 8, 8))
    catalog = tmp_path / "catalog.json"
    catalog.write_text(
        json.dumps({f"{a},{b},{a ^ b}": f"item{a}{b}" for a in range(8) for b in range(8)})
    )

    assert "ToyForCausalLM" not in _listed()
    _pip("install", "--no-deps", "--no-build-isolation", "--no-index", str(pkg))
    try:
        assert _listed()["ToyForCausalLM"] == "flashrec-models-toy"
        proc = _flashrec(
            "generate", "--model-path", str(ckpt), "--arch", "ToyForCausalLM",
            "--catalog", str(catalog), "--prompt", "w1 w2 w3", "-n", "5", "--json",
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        choices = json.loads(proc.stdout)["choices"]
        assert len(choices) == 5 and all(len(c["items"]) == 1 for c in choices)
        # the same checkpoint through the Qwen3 plugin ranks the same items: the toy is real
        ref = _flashrec(
            "generate", "--model-path", str(ckpt), "--catalog", str(catalog),
            "--prompt", "w1 w2 w3", "-n", "5", "--json",
        )  # fmt: skip
        assert ref.returncode == 0, ref.stderr
        assert [c["items"] for c in choices] == [
            c["items"] for c in json.loads(ref.stdout)["choices"]
        ]
    finally:
        _pip("uninstall", "-y", "flashrec-models-toy")
    assert "ToyForCausalLM" not in _listed()
