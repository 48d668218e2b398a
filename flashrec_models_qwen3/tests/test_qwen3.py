"""Qwen3 runs the shared conformance suite on its tiny example configs."""

from flashrec_core.testing import ModelConformance
from flashrec_models_qwen3 import spec


class TestQwen3(ModelConformance):
    spec = spec
