"""Triton kernels compiled for a GPU that is not here. A process under Triton's interpreter records each launch's
specialization (its arguments' types, its constexpr values) with :func:`record_launches`; another process, not
interpreting, compiles those specializations to a cubin for a named architecture (:func:`compile_for`) with
Triton's own compiler and ptxas, which need no device. So a kernel that runs under the interpreter, which is
lenient (numpy arithmetic), but would not compile for a GPU fails on the CPU."""
import inspect
import json
from pathlib import Path

import torch

SPECS_ENV = "LIPSFORMER_TRITON_SPECS"  # where a process under the interpreter writes its launches
SIZES = ("BLOCK", "ROWS", "SUM_BLOCK", "K", "TAPS")  # constexprs that size a kernel's blocks and loops
_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
          torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}


def _type(value) -> str:
    """Triton's type for a launch argument, as its JIT specialises it."""
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"a launch argument of type {type(value).__name__}")


def wrap_launches(wrapper):
    """A replacement for the interpreter's launch, ``GridExecutor.__call__`` (every Triton from 3.5 launches through
    it: 3.5 from ``kernel[grid]``, later ones from ``InterpretedFunction.run``), that calls
    ``wrapper(fn, values, launch)`` for each launch: the kernel's Python function, its arguments by name (its launch
    options among them) and the launch itself, to call."""
    from triton.runtime.interpreter import GridExecutor
    call = GridExecutor.__call__

    def launching(self, *args, **kwargs):
        values = {**dict(zip(self.arg_names, args)), **kwargs}
        return wrapper(self.fn, values, lambda: call(self, *args, **kwargs))

    return launching


def record_launches(path: str) -> None:
    """In a process under the interpreter: append every kernel launch's specialization to ``path`` (JSON lines),
    then run it."""
    from triton.runtime.interpreter import GridExecutor

    def recording(fn, values, launch):
        signature, constexprs = {}, {}
        for name, param in inspect.signature(fn).parameters.items():
            value = values.get(name, param.default)
            if "constexpr" in str(param.annotation) or value is None:
                signature[name], constexprs[name] = "constexpr", value
            else:
                signature[name] = _type(value)
        options = {k: values[k] for k in ("num_warps", "num_stages") if k in values}
        spec = dict(module=fn.__module__, name=fn.__name__, signature=signature, constexprs=constexprs,
                    options=options)
        with open(path, "a") as f:
            f.write(json.dumps(spec, sort_keys=True) + "\n")
        return launch()

    GridExecutor.__call__ = wrap_launches(recording)


def specializations(path: Path) -> list:
    """The distinct specializations recorded in ``path``."""
    return [json.loads(line) for line in sorted(set(Path(path).read_text().splitlines()))]


def richest(specs: list) -> list:
    """One specialization of each kernel: the one with its flags (constexprs but the sizes, :data:`SIZES`) highest
    (true over false, 3 over 2: the most branches compiled), among those the one with the most bfloat16 pointers
    (mixed precision's conversions)."""
    def rank(spec):
        flags = sum(int(v or 0) for k, v in spec["constexprs"].items() if k not in SIZES)
        return flags, sum(t == "*bf16" for t in spec["signature"].values())

    best = {}
    for spec in specs:
        if spec["name"] not in best or rank(spec) > rank(best[spec["name"]]):
            best[spec["name"]] = spec
    return [best[name] for name in sorted(best)]


def compile_for(spec: dict, arch: int, kernel=None):
    """Compile one recorded specialization (of ``kernel``, or the kernel it names) for CUDA compute capability
    ``arch`` (90: Hopper, 80: Ampere) to a cubin; returns Triton's compiled kernel (``.metadata.shared``: its shared
    memory in bytes). Raises what Triton raises for a kernel that does not compile."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    kernel = kernel or getattr(importlib.import_module(spec["module"]), spec["name"])
    source = ASTSource(fn=kernel, signature=spec["signature"], constexprs=spec["constexprs"])
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=spec["options"])


def kernels(module) -> dict:
    """The ``@triton.jit`` functions of ``module`` by name, in a process not interpreting."""
    from triton.runtime.jit import JITFunction
    return {name: f for name, f in vars(module).items() if isinstance(f, JITFunction)}
