"""A Triton kernel compiled once per specialisation, and its launch bound from the compiled kernel.

Triton's JIT dispatch (``kernel[grid](...)``) costs 8-17 us of host time on every call: the binder
specialises every argument, computes the cache key and the launch metadata, then calls the
compiled kernel's launcher. A repeated collective needs none of that. Here:

- :func:`compile_for` runs Triton's own binder on the arguments once (the same specialisation the
  JIT dispatch would make: integers equal to 1 become constants, 16-byte alignment is noted) and
  compiles for a target, the current GPU's or a named one (no GPU needed, as the tests and the
  host-time benchmark use it); compiled kernels are kept per specialisation. The ranks of a node
  that need the same kernel compile it one at a time (:func:`compile_lock`, per kernel): the first
  compiles into gpucomm's kernel cache (:func:`kernel_cache`, read only where it passes
  :mod:`gpucomm.toolchain.trusted_cache`'s check), the others then load it there instead of compiling the
  same kernel at once, and skip Triton's own cache key, which hashes Triton's libraries (cold
  start, docs/benchmarks.md);
- :func:`parameters` reads the kernel's parameter list from the compiled kernel: the arguments its
  signature keeps (constexprs and arguments specialised into constants are not parameters), then
  the hidden scratch pointers recent Triton versions append (global, profile: one per
  ``*_scratch_size`` field of the metadata), every one with its size;
- :func:`bind` loads the cubin through gpucomm's launcher (:mod:`gpucomm.ops.launcher`) and packs
  the parameters once: a launch is then one ``cuLaunchKernel``. Where the launcher cannot be built,
  :class:`CompiledLaunch` calls the compiled kernel's own launcher (still never the JIT dispatch).

What this cannot bind (:func:`bind` raises :class:`UnsupportedError`): kernels needing scratch
memory per launch, clusters, cooperative or PDL launches, tensor descriptors. The program kernel
needs none of them (tests/ops/test_program_launch_args.py binds every kind of its specialisations).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import tempfile
import types
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gpucomm.errors import UnsupportedError
from gpucomm.ops import launcher
from gpucomm.ops.device_guard import on_device
from gpucomm.ops.launcher import Param
from gpucomm.toolchain import native, trusted_cache

__all__ = ["compile_for", "compile_lock", "parameters", "bind", "bindable", "CompiledLaunch", "HIDDEN_POINTERS"]

# The hidden parameters Triton appends after the signature's, in order, where the metadata has
# their size field (Triton 3.9: both; the pointer is null where the size is 0).
HIDDEN_POINTERS = ("global_scratch", "profile_scratch")
# Bytes of a parameter of each Triton signature type (pointers: '*' then the element type).
_SIZES = {"i1": 1, "u1": 1, "i8": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4, "u32": 4, "i64": 8, "u64": 8}

# Whether ranks take turns compiling (bench/cold_start.py times both ways).
COMPILE_LOCK = True

_compiled: dict[tuple, Any] = {}
_functions: dict[tuple, int] = {}


def compile_for(
    fn: Any, target: Any, args: Sequence[object], constexprs: Mapping[str, object], options: Mapping[str, object]
) -> Any:
    """``fn`` (a ``triton.jit`` function) compiled for ``target`` as its JIT dispatch would specialise
    it on ``args`` and ``constexprs``, with compile ``options``: kept per specialisation in this
    process and in gpucomm's kernel cache (:func:`kernel_cache`), compiled where neither has it."""
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
    # What JITFunction.run adds to the caller's keywords before it binds them: debug and
    # instrumentation_mode (Triton 3.6, the lent GPU image's), fpsan_homomorphic_casts too (3.9).
    kwargs = {
        **constexprs,
        **options,
        "debug": fn.debug or knobs.runtime.debug,
        "instrumentation_mode": knobs.compilation.instrumentation_mode,
    }
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    bound_args, specialization, bound_options = binder(*args, **kwargs)
    key = (*key_base, repr(specialization), repr(sorted(bound_options.items(), key=lambda kv: kv[0])))
    kernel = _compiled.get(key)
    if kernel is not None:
        return kernel
    name = _disk_key(fn, target, key)
    kernel = CachedKernel.load(kernel_cache() / name)
    if kernel is None:
        stored = kernel_cache() / name  # the private folder, where the cache failed the check
        with compile_lock(stored):
            kernel = CachedKernel.load(stored)  # a peer may have compiled it while this rank waited
            if kernel is None:
                parsed, signature, constants, attrs = fn._pack_args(
                    backend, kwargs, bound_args, specialization, bound_options
                )
                compiled = triton.compile(
                    ASTSource(fn, signature, constants, attrs), target=target, options=parsed.__dict__
                )
                kernel = CachedKernel.store(stored, compiled)
    _compiled[key] = kernel
    return kernel


def kernel_cache() -> pathlib.Path:
    """Where compiled kernels are kept across processes: beside gpucomm's built host code (this
    process's private folder where that cache fails :mod:`gpucomm.toolchain.trusted_cache`'s check)."""
    return trusted_cache.folder("kernels")


def _disk_key(fn: Any, target: Any, key: tuple) -> str:
    """A compiled kernel's name in the cache: Triton's version, the kernel's source and what it
    depends on (``fn.cache_key``, Triton's own hash of them), the target, the specialisation and
    options, and the environment variables Triton says change a compile."""
    import triton
    from triton._C.libtriton import get_cache_invalidating_env_vars

    text = "\0".join(
        [
            triton.__version__,
            fn.cache_key,
            repr(target),
            *key[2:],
            repr(sorted(get_cache_invalidating_env_vars().items())),
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class CachedKernel:
    """A compiled kernel as this module reads it (its cubin and PTX, metadata, signature and
    constants), kept in gpucomm's kernel cache as one JSON file and the cubin beside it."""

    def __init__(
        self,
        asm: dict[str, Any],
        metadata: dict[str, Any],
        signature: dict[str, str],
        constants: list[int],
        kernel_hash: str,
    ) -> None:
        self.asm = asm
        self.metadata = types.SimpleNamespace(**metadata)
        self.src = types.SimpleNamespace(signature=signature, constants={(i,): None for i in constants})
        self.hash = kernel_hash

    @classmethod
    def store(cls, path: pathlib.Path, compiled: Any) -> CachedKernel:
        """``compiled`` (Triton's CompiledKernel) kept at ``path`` (written whole or not at all)."""
        meta = {
            k: v for k, v in compiled.metadata._asdict().items() if isinstance(v, (int, str, bool, float)) or v is None
        }
        meta["tensordesc_meta"] = bool(getattr(compiled.metadata, "tensordesc_meta", None))  # what bindable asks of it
        kernel = cls(
            {"cubin": compiled.asm["cubin"], "ptx": compiled.asm["ptx"]},
            meta,
            dict(compiled.src.signature),
            sorted(path_[0] for path_ in compiled.src.constants),
            compiled.hash,
        )
        record = {
            "metadata": meta,
            "signature": kernel.src.signature,
            "constants": sorted(i for (i,) in kernel.src.constants),
            "hash": kernel.hash,
            "ptx": kernel.asm["ptx"],
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        for suffix, data in (
            (".cubin", kernel.asm["cubin"]),
            (".json", json.dumps(record).encode()),
        ):  # the JSON last: it marks the entry whole
            fd, scratch = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(scratch, path.with_suffix(suffix))
        return kernel

    @classmethod
    def load(cls, path: pathlib.Path) -> CachedKernel | None:
        """The kernel kept at ``path``, or None (also where a file of it fails
        :mod:`gpucomm.toolchain.trusted_cache`'s check: another user could have written it)."""
        if not all(trusted_cache.file_ok(path.parent, path.with_suffix(s)) for s in (".json", ".cubin")):
            return None
        try:
            record = json.loads(path.with_suffix(".json").read_bytes())
            cubin = path.with_suffix(".cubin").read_bytes()
        except (OSError, ValueError):
            return None
        return cls(
            {"cubin": cubin, "ptx": record["ptx"]},
            record["metadata"],
            record["signature"],
            record["constants"],
            record["hash"],
        )


def compile_lock(stored: pathlib.Path) -> contextlib.AbstractContextManager[None]:
    """Held while this process compiles the kernel kept at ``stored``: the processes that need it
    (the ranks of a node) compile it one at a time, so that it is compiled once and the others
    load it; processes compiling other kernels do not wait (:func:`gpucomm.toolchain.native.build_lock`;
    off where COMPILE_LOCK is False)."""
    return native.build_lock(stored) if COMPILE_LOCK else contextlib.nullcontext()


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
            raise UnsupportedError(
                f"gpucomm: a Triton parameter of type {kind} ({name}) is not bound by gpucomm's launcher"
            )
        value = values[name]
        found.append(Param(name, size, value.data_ptr() if isinstance(value, torch.Tensor) else int(value)))
    found += [Param(name, 8, 0) for name in HIDDEN_POINTERS if hasattr(kernel.metadata, f"{name}_size")]
    return found


def bind(
    kernel: Any, drv: Any, device: int, grid: tuple[int, ...], values: Mapping[str, object], stream: int = 0
) -> Any:
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
        drv,
        function,
        parameters(kernel, values),
        grid=full_grid,
        block=(meta.num_warps * meta.warp_size, 1, 1),
        shared=meta.shared,
        stream=stream,
    )


class CompiledLaunch:
    """The launch of Triton's compiled kernel (a ``CompiledKernel``, from the JIT's ``warmup``)
    through its own launcher, which converts the arguments on each call: where gpucomm's launcher
    cannot be built. Never the JIT dispatch. Its launcher launches in the current context, so each
    launch runs with ``device`` (the kernel's) current."""

    def __init__(self, kernel: Any, grid: tuple[int, ...], values: Sequence[object], device: torch.device) -> None:
        self._run = kernel.run
        self._device = device
        self._head = (*(*grid, 1, 1)[:3],)
        self._tail = (kernel.function, kernel.packed_metadata, None, None, None, *values)

    def launch(self, stream: int) -> None:
        with on_device(self._device):
            self._run(*self._head, stream, *self._tail)
