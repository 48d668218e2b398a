"""Compile Triton kernels for a GPU architecture on a machine without one (a CI check).

The interpreter (how CPU tests run the kernels) never compiles, so a kernel can pass every CPU
test and still fail to build on the device. `compiled_launches` makes each `kernel[grid](...)`
launch compile for the target instead (Triton's compiler and its bundled ptxas), so calling a
kernel's launcher with small CPU tensors proves it builds. Plugins use it for their own
kernels. Needs a process without TRITON_INTERPRET (jit functions are then real JITFunctions).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "CompiledLaunch",
    "compiled_launches",
    "instruction_mix",
    "loop_schedule",
    "run_compile_script",
    "sass",
]

_POINTER_TYPES = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8e4nv", torch.int64: "i64", torch.int32: "i32", torch.int16: "i16",
    torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
}  # fmt: skip


@dataclass
class CompiledLaunch:
    kernel: str
    ptx: str
    cubin_bytes: int
    registers: int
    """Registers per thread (ptxas -v): with the launch's warps, how many programs fit an SM."""
    spill_bytes: int
    """Bytes of register spill stores plus loads per thread: local-memory traffic in a kernel
    meant to run at memory bandwidth (0 for every default launch; tests/kernels checks it)."""
    shared_bytes: int = 0
    """Shared memory a program takes (Triton's metadata): against the GPU's per-block limit,
    whether the launch can run there at all (an H100 allows 227 KB; consumer parts about 100)."""
    ttgir: str = ""
    """The Triton GPU IR after the compiler's passes: where its pipeliner put each loop's
    asynchronous copies, their shared-memory buffers, the waits and the tensor-core dots
    (`loop_schedule` lists them)."""


@dataclass
class _Recorder:
    arch: int
    launches: list[CompiledLaunch] = field(default_factory=list)

    def compile(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        params = fn.params
        values = dict(zip((p.name for p in params), args))
        values.update(kwargs)
        signature, constexprs, attrs = {}, {}, {}
        unspecialized = _unspecialized(fn)
        for i, p in enumerate(params):
            value = values.get(p.name, p.default)
            if p.is_constexpr or value is None:
                signature[p.name] = "constexpr"
                constexprs[(i,)] = value
            else:
                signature[p.name] = _type_of(value)
                if _divisible_by_16(value) and i not in unspecialized:
                    # as the JIT specializes on the device: pointers and integers that are
                    # multiples of 16 let the compiler vectorize loads (tt.divisibility)
                    attrs[(i,)] = [["tt.divisibility", 16]]
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        with triton.knobs.compilation.scope():
            # The cache may hold this kernel's entry without its PTX and IR (the device's runs
            # keep binaries only, TRITON_STORE_BINARY_ONLY in scripts/gpu_run.sh), and a compile
            # that stores binaries only returns none either: compile anew, keeping them.
            triton.knobs.compilation.always_compile = True
            triton.knobs.compilation.store_binary_only = False
            compiled = triton.compile(src, target=GPUTarget("cuda", self.arch, 32), options=options)
        ptx = compiled.asm["ptx"]
        registers, spills = _ptxas_resources(ptx, self.arch)
        launch = CompiledLaunch(
            fn.__name__, ptx, len(compiled.asm["cubin"]), registers, spills,
            compiled.metadata.shared, compiled.asm["ttgir"],
        )  # fmt: skip
        self.launches.append(launch)


def _ptxas_path(arch: int) -> str:
    from triton.backends.nvidia import compiler

    if hasattr(compiler, "get_ptxas"):  # Triton >= 3.4
        return str(compiler.get_ptxas(arch).path)
    return str(compiler._path_to_binary("ptxas")[0])


def sass(ptx: str) -> str:
    """The machine code (SASS) of the PTX's one kernel, from Triton's bundled ptxas and nvdisasm:
    what to count before a device call when a kernel may be bound by instruction issue rather
    than memory (session 40: the SiLU-mul kernel's ~1,550 instructions a thread at 119 us, 840
    after, at 95 us; docs/development.md)."""
    target = re.search(r"^\.target\s+sm_(\d+)(\w*)", ptx, re.MULTILINE)
    number, suffix = (int(target.group(1)), target.group(2)) if target else (90, "a")
    ptxas = _ptxas_path(number)
    nvdisasm = os.path.join(os.path.dirname(ptxas), "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        subprocess.run([ptxas, f"-arch=sm_{number}{suffix}", src, "-o", cubin], check=True,
                       capture_output=True)  # fmt: skip
        return subprocess.run([nvdisasm, "-c", cubin], check=True, capture_output=True,
                              text=True).stdout  # fmt: skip


_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)")


def instruction_mix(sass_text: str) -> dict[str, int]:
    """Instructions of a SASS listing by opcode (modifiers dropped, predicates ignored), most
    frequent first; the listing's static count, so a loop's body counts once."""
    counts: dict[str, int] = {}
    for line in sass_text.splitlines():
        match = _SASS_LINE.match(line)
        if match:
            counts[match.group(1)] = counts.get(match.group(1), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


_LABEL = re.compile(r"^(\.L_x_\d+):")
_BACK_BRANCH = re.compile(r"\bBRA\s+`\((\.L_x_\d+)\)")


def loop_bodies(sass_text: str) -> list[dict[str, int]]:
    """The instruction mix of each loop of a SASS listing, in listing order: the lines from a
    label to a branch back to it. A loop's body runs once an iteration, so these are the
    counts that scale with the trip count (the beam kernel's prompt loop: one 128-key chunk an
    iteration). An inner loop's lines are counted in the outer loop's body too."""
    lines = sass_text.splitlines()
    seen: dict[str, int] = {}
    bodies = []
    for i, line in enumerate(lines):
        label = _LABEL.match(line)
        if label:
            seen[label.group(1)] = i
            continue
        branch = _BACK_BRANCH.search(line)
        if branch and branch.group(1) in seen and i - seen[branch.group(1)] > 1:  # not a trap
            bodies.append(instruction_mix("\n".join(lines[seen[branch.group(1)] : i + 1])))
    return bodies


def _ptxas_resources(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spill bytes) of the PTX's one kernel, from Triton's bundled ptxas -v (the
    compiled kernel's own counts come from the driver, which needs a GPU)."""
    ptxas = _ptxas_path(arch)
    target = re.search(r"^\.target\s+(sm_\w+)", ptx, re.MULTILINE)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        arch = target.group(1) if target else "sm_90a"
        cmd = [ptxas, "-v", f"-arch={arch}", src, "-o", os.path.join(tmp, "kernel.cubin")]
        report = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if registers is None or spills is None:
        raise RuntimeError(f"unexpected ptxas -v report: {report[-500:]}")
    return int(registers.group(1)), int(spills.group(1)) + int(spills.group(2))


def _unspecialized(fn: Any) -> set[int]:
    """Indices of the parameters the kernel asks the JIT not to specialize."""
    names = [p.name for p in fn.params]
    out: set[int] = set()
    for entry in list(getattr(fn, "do_not_specialize", [])) + list(
        getattr(fn, "do_not_specialize_on_alignment", [])
    ):
        out.add(entry if isinstance(entry, int) else names.index(entry))
    return out


def _divisible_by_16(value: Any) -> bool:
    """A tensor whose data starts 16-byte aligned, or an integer multiple of 16 (not a bool)."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def _type_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type a kernel argument of {type(value).__name__}")


@contextlib.contextmanager
def compiled_launches(arch: int = 90) -> Iterator[list[CompiledLaunch]]:
    """Within the block, kernel launches compile for sm_`arch` instead of running (outputs stay
    unwritten); call the `launch_*` functions (the public wrappers refuse CPU tensors). Yields
    the list of compiled launches, filled as they happen."""
    from triton.runtime.jit import JITFunction

    recorder = _Recorder(arch)
    original_run = JITFunction.run

    def run(self: Any, *args: Any, grid: Any = None, warmup: bool = False, **kwargs: Any) -> None:
        recorder.compile(self, args, kwargs)

    JITFunction.run = run  # type: ignore[method-assign]
    try:
        yield recorder.launches
    finally:
        JITFunction.run = original_run  # type: ignore[method-assign]


_SCHEDULE_OPS = re.compile(
    r"scf\.for|scf\.yield|ttg\.async_copy_global_to_local|ttg\.async_wait|"
    r"ttng\.warp_group_dot(_wait)?|ttg\.local_alloc : \(\)|tt\.load|tt\.dot"
)
_SSA_NAME = re.compile(r"^\s*(%[\w.#:]+\s*=\s*)")


def loop_schedule(ttgir: str) -> list[str]:
    """The lines of `ttgir` that show how its loops are pipelined, in order, trimmed to the
    operation: loop heads and ends, shared-memory buffers (`local_alloc : ()`: the leading
    dimension is the number of stages a load is buffered for), asynchronous copies and their
    waits, plain loads, and the dots with their waits (Hopper's `warp_group_dot`;
    `pendings = 0` waits for every dot in flight). Session 35 read the prefill attention
    kernel's loop this way: one buffer for each of K and V, each chunk's copies issued after
    the chunk before had finished with them (docs/benchmarks.md)."""
    out = []
    for line in ttgir.splitlines():
        if not _SCHEDULE_OPS.search(line):
            continue
        text = _SSA_NAME.sub("", line).strip()
        out.append(text.split(" loc(")[0][:160])
    return out


def run_compile_script(script: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """Run `script` (Python source using `compiled_launches`) in a fresh interpreter without
    TRITON_INTERPRET, since test processes usually set it; stdout and stderr are captured."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout
    )
