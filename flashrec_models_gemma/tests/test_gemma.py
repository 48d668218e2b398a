"""Gemma and Gemma 2 run the shared conformance suite; plus the config rules of the family."""

from __future__ import annotations

import pytest

from flashrec_core.spec import ConfigError
from flashrec_core.testing import ModelConformance
from flashrec_models_gemma import gemma2_spec, gemma_spec


class TestGemma(ModelConformance):
    spec = gemma_spec


class TestGemma2(ModelConformance):
    spec = gemma2_spec


PUBLISHED = dict(gemma2_spec.examples[0].hf_config)


def test_gemma2_published_keys_give_alternating_windows_and_caps() -> None:
    config = gemma2_spec.parse_config(PUBLISHED)
    sliding, full = config.attention
    assert sliding.sliding_window == 8 and full.sliding_window is None
    assert sliding.logit_softcap == full.logit_softcap == 50.0
    assert sliding.scale == pytest.approx(24**-0.5)
    assert config.final_logit_softcap == 30.0 and config.tie_word_embeddings


def test_gemma2_defaults_are_transformers_defaults() -> None:
    bare = {k: v for k, v in PUBLISHED.items() if "softcapping" not in k and k != "sliding_window"}
    config = gemma2_spec.parse_config(bare)
    assert config.final_logit_softcap == 30.0 and config.attention[0].logit_softcap == 50.0
    assert config.attention[0].sliding_window == 4096


def test_gemma2_null_softcaps_turn_them_off() -> None:
    config = gemma2_spec.parse_config(
        {**PUBLISHED, "attn_logit_softcapping": None, "final_logit_softcapping": None}
    )
    assert config.final_logit_softcap is None
    assert all(s.logit_softcap is None for s in config.attention)


@pytest.mark.parametrize(
    ("spec", "change", "message"),
    [
        (gemma2_spec, {"hidden_activation": "relu"}, "'hidden_activation' is 'relu'"),
        (gemma_spec, {"hidden_act": "silu"}, "'hidden_act' is 'silu'"),
        (gemma2_spec, {"layer_types": ["full_attention"]}, "'layer_types'"),
        (gemma2_spec, {"layer_types": ["full_attention", "chunked"]}, "'layer_types'"),
    ],
)
def test_config_errors_name_the_key(spec, change: dict, message: str) -> None:
    base = PUBLISHED if spec is gemma2_spec else dict(gemma_spec.examples[0].hf_config)
    with pytest.raises(ConfigError, match=message):
        spec.parse_config({**base, **change})
