"""RoPE: inverse frequencies against transformers' own init functions; the rotation itself."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import Qwen3Config as HFQwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

import flashrec_models_qwen3
from flashrec_core.layers import BuildContext, RotaryEmbedding, apply_rope, rope_inv_freq
from flashrec_core.spec import ConfigError, RopeConfig

SPEC = flashrec_models_qwen3.spec
HEAD_DIM = 64
REL = 1e-6

ROPE_CASES: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 1e6},
    "linear": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.5},
    "linear-partial": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0,
                       "partial_rotary_factor": 0.5},
    "llama3": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
             "original_max_position_embeddings": 256},
    "yarn-betas": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "beta_fast": 16.0,
                   "beta_slow": 2.0, "original_max_position_embeddings": 128},
    "yarn-attention-factor": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                              "attention_factor": 0.9, "original_max_position_embeddings": 256},
    "yarn-default-original": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
    "yarn-partial": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                     "original_max_position_embeddings": 256, "partial_rotary_factor": 0.5},
}  # fmt: skip


def _hf_dict(rope_parameters: dict[str, Any]) -> dict[str, Any]:
    hf = {k: v for k, v in SPEC.examples[0].hf_config.items() if k != "rope_theta"}
    return {**hf, "head_dim": HEAD_DIM, "rope_parameters": dict(rope_parameters)}


def _hf_rope(rope_parameters: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling exactly as transformers' Qwen3 model computes them."""
    hf = {k: v for k, v in _hf_dict(rope_parameters).items() if k != "model_type"}
    emb = Qwen3RotaryEmbedding(HFQwen3Config(**hf))
    return emb.inv_freq, emb.attention_scaling


def _ours(rope_parameters: dict[str, Any]) -> RopeConfig:
    return SPEC.parse_config(_hf_dict(rope_parameters)).rope


@pytest.mark.parametrize("case", ROPE_CASES)
def test_inv_freq_matches_transformers(case: str) -> None:
    ref_freq, ref_scaling = _hf_rope(ROPE_CASES[case])
    inv_freq, scaling = rope_inv_freq(_ours(ROPE_CASES[case]))
    assert inv_freq.shape == ref_freq.shape
    assert inv_freq.dtype == torch.float32
    rel = ((inv_freq - ref_freq).abs() / ref_freq.abs()).max().item()
    assert rel <= REL, f"{case}: inv_freq max relative error {rel:.3g}"
    assert scaling == pytest.approx(ref_scaling, rel=REL)


def test_scaled_rope_cases_really_differ_from_default() -> None:
    """Guards the parity test: each scaled case changes inv_freq or the attention scaling."""
    base, _ = rope_inv_freq(RopeConfig(theta=1e4, rotary_dim=HEAD_DIM))
    for case in ("linear", "yarn", "yarn-betas"):
        inv_freq, scaling = rope_inv_freq(_ours(ROPE_CASES[case]))
        assert not torch.allclose(inv_freq, base), case
    llama3, _ = rope_inv_freq(_ours(ROPE_CASES["llama3"]))
    plain, _ = rope_inv_freq(RopeConfig(theta=5e5, rotary_dim=HEAD_DIM))
    ratio = plain / llama3  # 1 (high freq), 8 (low freq) and smoothed values in between
    assert ratio.min().item() == pytest.approx(1.0) and ratio.max().item() == pytest.approx(8.0)
    assert ((ratio > 1.01) & (ratio < 7.99)).any()
    assert rope_inv_freq(_ours(ROPE_CASES["yarn"]))[1] == pytest.approx(0.1 * math.log(4) + 1)


@pytest.mark.parametrize(
    "extra",
    [{"mscale": 0.707, "mscale_all_dim": 1.0}, {"truncate": False}],
    ids=["mscale", "truncate"],
)
def test_yarn_options_are_honoured_or_rejected(extra: dict[str, Any]) -> None:
    params = {**ROPE_CASES["yarn"], **extra}
    ref_freq, ref_scaling = _hf_rope(params)
    try:
        rope = _ours(params)
    except ConfigError as exc:
        assert any(k in str(exc) for k in extra)
        return
    inv_freq, scaling = rope_inv_freq(rope)
    assert torch.allclose(inv_freq, ref_freq, rtol=REL, atol=0)
    assert scaling == pytest.approx(ref_scaling, rel=REL)


def _complex_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Neox RoPE as complex products: pair (x[i], x[i + half]) turned by pos * inv_freq[i]."""
    half = inv_freq.numel()
    x64 = x.double()
    z = torch.complex(x64[..., :half], x64[..., half : 2 * half])
    angles = positions.double()[:, None] * inv_freq.double()[None, :]  # [T, half]
    z = z * torch.polar(torch.ones_like(angles), angles)[:, None, :]
    return torch.cat([z.real, z.imag, x64[..., 2 * half :]], dim=-1)


@pytest.mark.parametrize("rotary_dim", [16, 8], ids=["full", "partial"])
def test_apply_rope_matches_complex_rotation(rotary_dim: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 16, generator=gen)  # [T, H, D]
    positions = torch.tensor([0, 1, 2, 5, 17, 100, 1023])
    inv_freq, _ = rope_inv_freq(RopeConfig(theta=1e4, rotary_dim=rotary_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    got = apply_rope(x, angles.cos(), angles.sin())
    ref = _complex_rope(x, positions, inv_freq)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.allclose(got.double(), ref, rtol=0, atol=1e-5)
    assert torch.equal(got[0], x[0]), "position 0 is the identity"
    assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:]), "pass-through dims untouched"


def test_apply_rope_keeps_bf16_dtype() -> None:
    x = torch.randn(4, 2, 8).to(torch.bfloat16)
    positions = torch.arange(4)
    inv_freq, _ = rope_inv_freq(RopeConfig(theta=1e4, rotary_dim=8))
    angles = positions.float()[:, None] * inv_freq[None, :]
    got = apply_rope(x, angles.cos(), angles.sin())
    assert got.dtype == torch.bfloat16
    ref = _complex_rope(x.float(), positions, inv_freq).to(torch.bfloat16)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("case", ["default", "yarn"])
def test_rotary_embedding_matches_transformers_rotation(case: str) -> None:
    """The module's eager path (cache lookup + scaling + rotation) vs transformers' Qwen3 RoPE."""
    params = ROPE_CASES[case]
    hf = {k: v for k, v in _hf_dict(params).items() if k != "model_type"}
    hf_rope = Qwen3RotaryEmbedding(HFQwen3Config(**hf))
    ctx = BuildContext(device=torch.device("cpu"), dtype=torch.float32)
    ours = RotaryEmbedding(_ours(params), max_position=1024, ctx=ctx)
    gen = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 3, 64, 255, 700, 1023])
    q = torch.randn(6, 4, HEAD_DIM, generator=gen)
    k = torch.randn(6, 2, HEAD_DIM, generator=gen)
    got_q, got_k, stored = ours(q, k, k, SimpleNamespace(positions=positions), layer_id=0)
    assert stored is False
    cos, sin = hf_rope(q, positions[None, :])  # [1, T, D]
    ref_q, ref_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )  # [1, H, T, D]
    assert torch.allclose(got_q, ref_q[0].transpose(0, 1), rtol=0, atol=1e-5)
    assert torch.allclose(got_k, ref_k[0].transpose(0, 1), rtol=0, atol=1e-5)
