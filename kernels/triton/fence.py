"""``fence_sys(lanes)``: a system-scope memory fence in every thread that holds a lane of ``lanes``,
the Triton twin of CUDA's ``__threadfence_system()`` (both ``membar.sys`` in the PTX).

The signal kernel runs it before its release stores: the data a flag announces was written by
this rank's earlier kernels in stream order, not by the signalling thread, and the fence makes
those writes visible at system scope (to a peer GPU, to the host) before any flag changes, as the
CUDA signal kernel does (docs/kernel-contract.md, "One memory contract").

Chosen when this module is imported, as :mod:`clock` is: on a GPU an inline ``membar.sys``; under
the Triton interpreter (``TRITON_INTERPRET=1``), which cannot run inline PTX, nothing: there each
kernel runs in the host's Python on shared memory, its earlier writes done before the release
store that follows.
"""

import triton
import triton.language as tl

from gpucomm._kernels.triton.clock import INTERPRETED

__all__ = ["fence_sys"]

if INTERPRETED:

    @triton.jit
    def fence_sys(lanes):
        """Nothing under the interpreter (see the module's docstring)."""
        return lanes

else:

    @triton.jit
    def fence_sys(lanes):
        """``membar.sys`` in the thread of each lane; ``lanes`` (int32) only gives the shape."""
        return tl.inline_asm_elementwise(
            "membar.sys; mov.b32 $0, 0;", "=r,r", [lanes], dtype=tl.int32, is_pure=False, pack=1
        )
