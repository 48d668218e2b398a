"""The conformance suite every model plugin runs: subclass `ModelConformance`, name the spec.

    class TestMyFamily(ModelConformance):
        spec = flashrec_models_myfamily.spec

Tests parametrized by `example` run once per tiny example config of the spec. Checkpoints are
written by `transformers` (random weights, safetensors) at test time; nothing is downloaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from flashrec_core.engine import create_build_context
from flashrec_core.layers import FP8_DTYPE
from flashrec_core.loader import WeightLoader
from flashrec_core.spec import SUPPORTED_CONTRACTS, ExampleConfig, FusedPath, ModelSpec
from flashrec_core.testing.beam_conformance import BeamSearchConformance
from flashrec_core.testing.fp8_checkpoint import write_fp8_checkpoint
from flashrec_core.testing.gpu_conformance import GpuConformance
from flashrec_core.testing.oracle import (
    assert_close_to_reference,
    create_runner,
    engine_decode_logits,
    engine_prefill_logits,
    hf_logits,
)

PARITY_REL = 1e-4
"""fp32 engine vs fp32 transformers: only summation order differs (~1e-6 relative measured)."""
FP8_REL_L2 = 0.15
"""FP8 W8A8 vs fp32 logits, relative L2 error. e4m3 keeps 3 mantissa bits (relative rounding
error <= 2^-4 per operand, ~2^-4/sqrt(3) RMS); weights and activations both rounded give ~5% RMS
per GEMM, which partially averages out; 15% leaves room for 2 layers of compounding."""

PROMPTS = ([5, 9, 17, 23, 8, 41, 30, 12, 7], [44, 3], [11, 12, 13, 14, 15], [20])
CONTINUATIONS = ([6, 18, 33, 2, 9], [10, 10, 4, 21, 37], [50, 1, 8, 8, 19], [3, 4, 5, 6, 7])
LONG_PROMPT = 40
"""Tokens of the long prompt every logits test adds; longer still past a declared window."""


def long_prompt_len(config: Any) -> int:
    """Longer than any sliding window the config declares (by more than a decode's 5 steps)."""
    window = config.max_sliding_window() if hasattr(config, "max_sliding_window") else None
    return max(LONG_PROMPT, (window or 0) + 9)


def prompts_for(config: Any) -> tuple[tuple[list[int], ...], tuple[list[int], ...]]:
    """The fixed prompts plus one longer than any window, and a continuation for each."""
    length = long_prompt_len(config)
    long = [3 + (i * 7919) % 52 for i in range(length)]  # word-vocab ids, deterministic
    prompts = (*[list(p) for p in PROMPTS], long)
    return prompts, (*[list(c) for c in CONTINUATIONS], [9, 8, 7, 6, 5])


class ModelConformance(BeamSearchConformance, GpuConformance):
    """Shared checks for one ModelSpec; subclasses set `spec`. Beam-search checks and the GPU
    tier (marked `gpu`, skipped without CUDA) are inherited."""

    spec: ClassVar[ModelSpec]

    def test_spec_is_valid(self) -> None:
        spec = self.spec
        assert isinstance(spec, ModelSpec), f"{spec!r} does not satisfy the ModelSpec protocol"
        assert spec.contract_version in SUPPORTED_CONTRACTS, spec.contract_version
        assert spec.architectures and all(a.endswith("ForCausalLM") for a in spec.architectures)
        assert len(spec.examples) >= 2, "give at least two tiny example configs (tied, untied)"
        configs = [spec.parse_config(e.hf_config) for e in spec.examples]
        # parsed, not the dicts: an example may rely on the family's default
        assert any(c.tie_word_embeddings for c in configs), "no example with tied embeddings"
        assert any(not c.tie_word_embeddings for c in configs), "no example with an untied head"
        names = [c.name for c in spec.capabilities]
        assert len(names) == len(set(names)), f"duplicate capabilities: {names}"
        assert all(isinstance(c, FusedPath) for c in spec.capabilities)
        for example in spec.examples:
            config = spec.parse_config(example.hf_config)
            assert config.architecture in spec.architectures

    def test_spec_buckets_match_model(self, example: ExampleConfig) -> None:
        model, _ = _build_empty(self.spec, example, fp8=False)
        modules = dict(model.named_modules())
        for bucket in self.spec.weight_map.buckets:
            fused = [m for n, m in modules.items() if n.endswith("." + bucket.param)]
            assert fused, f"no module ends with bucket param '{bucket.param}'"
            for m in fused:
                assert len(m.output_sizes) == len(bucket.sources), (
                    f"{bucket.param}: {len(m.output_sizes)} output_sizes vs {bucket.sources}"
                )

    def test_strict_load_matches_checkpoint(self, example: ExampleConfig, tiny_checkpoint) -> None:
        path, hf = tiny_checkpoint(self.spec, example)
        runner = create_runner(path)
        state = hf.state_dict()
        params = dict(runner.model.named_parameters())
        loader = WeightLoader(runner.model, self.spec, runner.config)
        for name, tensor in state.items():
            if loader.is_ignored(name):
                continue
            target = loader.target(name)
            if target.param in loader.tied:
                continue
            param = params[target.param]
            module = dict(runner.model.named_modules())[target.module]
            sizes = getattr(module, "output_sizes", (param.shape[0],))
            start = sum(sizes[: target.shard]) if target.num_shards > 1 else 0
            rows = param[start : start + tensor.shape[0]]
            assert torch.equal(rows, tensor.to(rows.dtype)), f"{name} -> {target.param} differs"

    def test_lm_head_contract(self, example: ExampleConfig, tiny_checkpoint) -> None:
        path, hf = tiny_checkpoint(self.spec, example)
        runner = create_runner(path)
        head = runner.model.lm_head()
        config = runner.config
        assert head.shape == (config.vocab_size, config.hidden_size)
        assert runner.model.lm_head().data_ptr() == head.data_ptr(), "lm_head() must be stable"
        assert torch.equal(head, hf.get_output_embeddings().weight.to(head.dtype))
        embed = hf.get_input_embeddings().weight
        if config.tie_word_embeddings:
            embeds = [p for n, p in runner.model.named_parameters() if p.shape == head.shape]
            assert any(p.data_ptr() == head.data_ptr() for p in embeds)
            assert torch.equal(head, embed.to(head.dtype))

    def test_attention_specs_agree_with_config(self, example: ExampleConfig) -> None:
        """Every Attention module attends as `ModelConfig.attention_spec(layer)` declares (what
        the backends plan with)."""
        from flashrec_core.layers import Attention

        model, config = _build_empty(self.spec, example, fp8=False)
        attns = [m for m in model.modules() if isinstance(m, Attention)]
        assert len(attns) == config.num_layers, f"{len(attns)} Attention modules"
        for m in attns:
            declared = config.attention_spec(m.layer_id)
            assert m.spec == declared, f"layer {m.layer_id}: module {m.spec} vs config {declared}"

    def test_prefill_logits_match_transformers(
        self, example: ExampleConfig, tiny_checkpoint
    ) -> None:
        path, hf = tiny_checkpoint(self.spec, example)
        runner = create_runner(path)
        prompts, _ = prompts_for(runner.config)
        got = engine_prefill_logits(runner, prompts)
        for i, (g, r) in enumerate(zip(got, hf_logits(hf, prompts))):
            what = (
                f"torch attention backend, prefill logits of prompt {i} ({len(prompts[i])} tokens)"
            )
            assert_close_to_reference(g, r, PARITY_REL, what)

    def test_decode_logits_match_transformers(
        self, example: ExampleConfig, tiny_checkpoint
    ) -> None:
        path, hf = tiny_checkpoint(self.spec, example)
        runner = create_runner(path)
        prompts, continuations = prompts_for(runner.config)
        got = engine_decode_logits(runner, prompts, continuations)
        full = [list(p) + list(c) for p, c in zip(prompts, continuations)]
        for i, (g, r) in enumerate(zip(got, hf_logits(hf, full))):
            steps = len(continuations[i])
            what = f"torch attention backend, decode logits of sequence {i} ({len(full[i])} tokens)"
            assert_close_to_reference(g, r[-steps:], PARITY_REL, what)
        assert runner.allocator.num_free == runner.allocator.num_slots - 1, "slots leaked"

    def test_fp8_error_is_bounded(self, example: ExampleConfig, tiny_checkpoint) -> None:
        path, hf = tiny_checkpoint(self.spec, example)
        runner = create_runner(path, quantization="fp8")
        assert any(p.dtype == FP8_DTYPE for p in runner.model.parameters()), "no FP8 weights"
        prompts, _ = prompts_for(runner.config)
        for i, (g, r) in enumerate(
            zip(engine_prefill_logits(runner, prompts), hf_logits(hf, prompts))
        ):
            rel = ((g - r).norm() / r.norm()).item()
            assert rel < FP8_REL_L2, (
                f"FP8 W8A8 GEMM path (eager quantization, no fused kernel): prompt {i} logits "
                f"relative L2 error {rel:.3f} >= {FP8_REL_L2} vs fp32 transformers"
            )

    def test_fp8_checkpoint_loads_like_online_quantization(
        self, example: ExampleConfig, tiny_checkpoint, tmp_path: Path
    ) -> None:
        path, _ = tiny_checkpoint(self.spec, example)
        online = create_runner(path, quantization="fp8")
        fp8_dir = tmp_path / "fp8"
        quantized = write_fp8_checkpoint(
            Path(path), fp8_dir, self.spec, online.config, online.model
        )
        assert quantized, "the spec maps no checkpoint tensor onto a Linear"
        stored = create_runner(fp8_dir)  # quantization_config alone turns FP8 on
        assert stored.config.quantization is not None
        online_params = dict(online.model.named_parameters())
        for name, p in stored.model.named_parameters():
            assert p.dtype == online_params[name].dtype, f"{name}: dtype differs"
            assert torch.equal(p.float(), online_params[name].float()), f"{name} differs"

    def test_fp8_per_tensor_checkpoint_keeps_its_scales(
        self, example: ExampleConfig, tiny_checkpoint, tmp_path: Path
    ) -> None:
        from safetensors.torch import load_file

        path, _ = tiny_checkpoint(self.spec, example)
        online = create_runner(path, quantization="fp8")
        fp8_dir = tmp_path / "fp8t"
        write_fp8_checkpoint(
            Path(path), fp8_dir, self.spec, online.config, online.model, per_tensor=True
        )
        stored = create_runner(fp8_dir)
        tensors = load_file(str(fp8_dir / "model.safetensors"))
        loader = WeightLoader(stored.model, self.spec, stored.config)
        modules = dict(stored.model.named_modules())
        for name, t in tensors.items():
            if t.dtype != FP8_DTYPE:
                continue
            target = loader.target(name)
            module = modules[target.module]
            start = sum(module.output_sizes[: target.shard])
            rows = slice(start, start + t.shape[0])
            scale = tensors[name.removesuffix(".weight") + ".weight_scale"]
            assert torch.equal(module.weight[rows].view(torch.uint8), t.view(torch.uint8)), name
            assert torch.all(module.weight_scale[rows] == scale.float()), f"{name}: scale"

    def test_fused_paths_equal_eager(self, example: ExampleConfig, tiny_checkpoint) -> None:
        """Each fused path (Triton, interpreted on CPU) alone == the eager fallback; a failure
        names the path and its kernel."""
        if not self.spec.capabilities:
            pytest.skip("the spec declares no fused paths")
        pytest.importorskip("triton")
        path, _ = tiny_checkpoint(self.spec, example)
        prompts = [list(p) for p in PROMPTS[:2]]
        script = textwrap.dedent(_FUSED_SCRIPT).format(path=str(path), prompts=prompts)
        env = {**os.environ, "TRITON_INTERPRET": "1"} if not torch.cuda.is_available() else None
        proc = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]


_FUSED_SCRIPT = """
import torch
from flashrec_core.testing.oracle import create_runner, engine_prefill_logits, assert_close_to_reference
cuda = torch.cuda.is_available()
# fp32 activations and torch attention on both devices: the runners then differ only in the
# fused kernels (FlashInfer has no kernels for the examples' head_dim 16; bf16 would add rounding
# points the fused kernels skip). The GPU tier checks the bf16 + FlashInfer paths end to end.
common = dict(device="cuda" if cuda else "cpu", triton_on_cpu=not cuda, quantization="fp8",
              dtype="float32", attention_backend="torch")
switches = sorted({{c.switch for c in create_runner({path!r}, **common).loaded.spec.capabilities}})
eager = create_runner({path!r}, **common, disabled_fused=tuple(switches))
assert not eager.loaded.context.fused, eager.loaded.context.fused
prompts = {prompts}
reference = engine_prefill_logits(eager, prompts)
for switch in switches:
    only = create_runner({path!r}, **common, disabled_fused=tuple(s for s in switches if s != switch))
    paths = sorted(only.loaded.context.fused)
    assert paths, f"{{switch}}: no fused path resolved on"
    kernels = [c.kernel for c in only.loaded.spec.capabilities if c.name in paths]
    for g, r in zip(engine_prefill_logits(only, prompts), reference):
        # same math, same FP8 rounding points; only fp32 summation order differs
        assert_close_to_reference(g, r, 1e-3, f"fused path {{paths}} ({{kernels}}) vs eager")
    print("fused path ok:", paths)
"""


def _build_empty(spec: ModelSpec, example: ExampleConfig, fp8: bool) -> tuple[Any, Any]:
    from flashrec_core.config import EngineConfig

    config = spec.parse_config(example.hf_config)
    cfg = EngineConfig(
        model_path="<none>", device="cpu", dtype="float32", quantization="fp8" if fp8 else "none",
        kv_cache_dtype="float32",
    )  # fmt: skip
    ctx, _ = create_build_context(spec, cfg)
    return spec.load_model_class()(config, ctx), config
