"""Runs first for every test under tests/: without CUDA, Triton kernels run in the interpreter.

Triton reads TRITON_INTERPRET when a kernel is decorated, and some imports (torch._dynamo, used
by the trie's capture-safety test) pull triton in, so the variable is set here, before any test
module is collected. On CUDA it stays unset, or the kernels would run interpreted.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
