"""A Triton kernel compiled once per specialisation, and its launch bound from the compiled kernel.

Triton's JIT dispatch (``kernel[grid](...)``) costs 8-17 us of host time on every call: the binder
specialises every argument, computes the cache key and the launch metadata, then calls the
compiled kernel's launcher. A repeated collective needs none of that. Here:

- :func:`compile_for` runs Triton's own binder on the arguments once (the same specialisation the
  JIT dispatch would make: integers equal to 1 become constants, 16-byte alignment is noted) and
  compiles for a target, the current GPU's or a named one (no GPU needed, as the tests and the
  host-time benchmark use it); compiled kernels are kept per specialisation;
- :func:`parameters` reads the kernel's parameter list from the compiled kernel: the arguments its
  signature keeps (constexprs and arguments specialised into constants are not parameters), then
  the hidden scratch pointers recent Triton versions append (global, profile: one per
  ``*_scratch_size`` field of the metadata), every one with its size;
- :func:`bind` loads the cubin through gpucomm's launcher (:mod:`gpucomm.ops.launcher`) and packs
  the parameters once: a launch is then one ``cuLaunchKernel``. Where the launcher cannot be built,
  :class:`CompiledLaunch` calls the compiled kernel's own launcher (still never the JIT dispatch).

What this cannot bind (it then raises :class:`UnsupportedError`, and the caller keeps the
compiled kernel's launcher): kernels needing scratch memory per launch, clusters, cooperative or
PDL launches, tensor descriptors. The program kernel needs none of them (checked by the tests).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gpucomm.errors import UnsupportedError
from gpucomm.ops import launcher
from gpucomm.ops.launcher import Param

__all__ = ["compile_for", "parameters", "bind", "bindable", "CompiledLaunch", "HIDDEN_POINTERS"]

# The hidden parameters Triton appends after the signature's, in order, where the metadata has
# their size field (Triton 3.9: both; the pointer is null where the size is 0).
HIDDEN_POINTERS = ("global_scratch", "profile_scratch")
# Bytes of a parameter of each Triton signature type (pointers: '*' then the element type).
_SIZES = {"i1": 1, "u1": 1, "i8": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4, "u32": 4, "i64": 8, "u64": 8}

_compiled: dict[tuple, Any] = {}
_functions: dict[tuple, int] = {}


def compile_for(fn: Any, target: Any, args: Sequence[object], constexprs: Mapping[str, object], options: Mapping[str, object]) -> Any:
    """``fn`` (a ``triton.jit`` function) compiled for ``target`` as its JIT dispatch would specialise
    it on ``args`` and ``constexprs``, with compile ``options``; kept per specialisation."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    key_base = (fn, target)
    binder_key = (*key_base, "binder")
    entry = _compiled.get(binder_key)
    if entry is None:
        backend = make_backend(target)
        entry = _compiled[binder_key] = (backend, create_function_from_signature(fn.signature, fn.params, backend))
    backend, binder = entry
    # What JITFunction.run adds to the caller's keywords before it binds them.
    kwargs = {
        **constexprs, **options, "debug": fn.debug or knobs.runtime.debug,
        "instrumentation_mode": knobs.compilation.instrumentation_mode,
        "fpsan_homomorphic_casts": knobs.compilation.fpsan_homomorphic_casts,
    }
    bound_args, specialization, bound_options = binder(*args, **kwargs)
    key = (*key_base, repr(specialization), repr(sorted(bound_options.items(), key=lambda kv: kv[0])))
    kernel = _compiled.get(key)
    if kernel is None:
        parsed, signature, constants, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, bound_options)
        kernel = _compiled[key] = triton.compile(ASTSource(fn, signature, constants, attrs), target=target, options=parsed.__dict__)
    return kernel


def bindable(kernel: Any) -> str | None:
    """Why ``kernel`` cannot be bound here, or None."""
    meta = kernel.metadata
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        return "it needs scratch memory per launch"
    if getattr(meta, "num_ctas", 1) != 1:
        return "it launches clusters"
    if getattr(meta, "launch_cooperative_grid", False) or getattr(meta, "launch_pdl", False):
        return "it launches cooperatively or with programmatic dependent launch"
    if getattr(meta, "tensordesc_meta", None):
        return "it takes tensor descriptors"
    return None


def parameters(kernel: Any, values: Mapping[str, object]) -> list[Param]:
    """The parameters of the compiled ``kernel`` in order, carrying ``values`` (by argument name;
    tensors give their address) and null hidden scratch pointers."""
    found = []
    constants = {path[0] for path in getattr(kernel.src, "constants", {})}
    for index, (name, kind) in enumerate(kernel.src.signature.items()):
        if kind == "constexpr" or index in constants:
            continue
        size = 8 if kind.startswith("*") else _SIZES.get(kind)
        if size is None:
            raise UnsupportedError(f"gpucomm: a Triton parameter of type {kind} ({name}) is not bound by gpucomm's launcher")
        value = values[name]
        found.append(Param(name, size, value.data_ptr() if isinstance(value, torch.Tensor) else int(value)))
    found += [Param(name, 8, 0) for name in HIDDEN_POINTERS if hasattr(kernel.metadata, f"{name}_size")]
    return found


def bind(kernel: Any, drv: Any, device: int, grid: tuple[int, ...], values: Mapping[str, object], stream: int = 0) -> Any:
    """The launch of the compiled ``kernel`` over ``grid`` with ``values`` (every argument by name),
    through the launcher on ``drv``: a ``Bound`` (``launch(stream)``; called bare, on ``stream``)."""
    why = bindable(kernel)
    if why is not None:
        raise UnsupportedError(f"gpucomm: {kernel.metadata.name} is not bound by gpucomm's launcher: {why}")
    key = (id(drv), kernel.hash, device)
    function = _functions.get(key)
    if function is None:
        function = _functions[key] = drv.load(kernel.asm["cubin"], kernel.metadata.name, device)
    meta = kernel.metadata
    full_grid = (*grid, 1, 1)[:3]
    return launcher.bind(
        drv, function, parameters(kernel, values), grid=full_grid, block=(meta.num_warps * meta.warp_size, 1, 1),
        shared=meta.shared, stream=stream,
    )


class CompiledLaunch:
    """The launch of a compiled kernel through its own launcher (Triton's C launcher, which converts
    the arguments on each call): where gpucomm's launcher cannot be built. Never the JIT dispatch."""

    def __init__(self, kernel: Any, grid: tuple[int, ...], values: Sequence[object]) -> None:
        self._run = kernel.run  # loads the module on the current device
        self._head = (*(*grid, 1, 1)[:3],)
        self._tail = (kernel.function, kernel.packed_metadata, None, None, None, *values)

    def launch(self, stream: int) -> None:
        self._run(*self._head, stream, *self._tail)
