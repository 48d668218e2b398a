"""Phi runs the shared conformance suite on its tiny example configs, plus its config checks."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from flashrec_core.spec import ConfigError
from flashrec_core.testing import ModelConformance
from flashrec_models_phi import spec


class TestPhi(ModelConformance):
    spec = spec


def _tiny(**overrides: Any) -> dict[str, Any]:
    """The untied example's config.json with some fields replaced."""
    return {**spec.examples[0].hf_config, **overrides}


def test_rejects_qk_layernorm_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="qk_layernorm"):
        spec.parse_config(_tiny(qk_layernorm=True))


@pytest.mark.parametrize("act", ["gelu", "relu", "silu"])
def test_rejects_other_activations_naming_them(act: str) -> None:
    with pytest.raises(ConfigError, match=f"hidden_act='{act}'"):
        spec.parse_config(_tiny(hidden_act=act))


def test_missing_layer_norm_eps_is_named() -> None:
    hf = {k: v for k, v in _tiny().items() if k != "layer_norm_eps"}
    with pytest.raises(ConfigError, match="layer_norm_eps"):
        spec.parse_config(hf)


def test_phi_config_defaults_apply_when_absent() -> None:
    """Fields transformers' PhiConfig fills itself: null kv heads (MHA), rotary 0.5, gelu_new."""
    hf = {k: v for k, v in _tiny().items() if k not in ("partial_rotary_factor", "hidden_act")}
    config = spec.parse_config(hf | {"num_key_value_heads": None})
    assert config.num_kv_heads == config.num_q_heads == 4
    assert config.rope.rotary_dim == config.head_dim // 2


def test_partial_rotary_from_rope_parameters() -> None:
    """transformers 5 writes partial_rotary_factor inside rope_parameters."""
    hf = {k: v for k, v in _tiny().items() if k not in ("partial_rotary_factor", "rope_theta")}
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.4}
    assert spec.parse_config(hf | {"rope_parameters": rope}).rope.rotary_dim == 6


def test_import_needs_no_triton() -> None:
    code = (
        "import sys, flashrec_models_phi, flashrec_models_phi.kernels;"
        "assert 'triton' not in sys.modules, 'importing the plugin imported triton'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
