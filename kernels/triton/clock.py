"""``clock_ns_lanes(lanes)``: the wall clock a kernel's bounded waits measure their deadline with,
read by every thread that holds a lane of ``lanes`` (one value per lane).

A per-thread reading must never steer control flow by itself: threads read it at different
moments, so they would disagree about a deadline. It is therefore a tensor, and a kernel takes a
block-wide reduction of it (kernels/triton/program.py's ``_wait_status``). A scalar would be worse
than wrong: Triton assumes a scalar is the same in every thread, and would branch on it as such.

On a GPU it is ``%globaltimer`` (nanoseconds, the same clock on every SM). Under the Triton
interpreter (``TRITON_INTERPRET=1``, the CPU emulation CI runs) kernels execute as Python, and
the host's monotonic clock is read instead: a poll of a flag there takes 0.3-1 ms depending on
how many ranks share the cores (measured on the 2-core CI machine), so a deadline counted in
polls would fire anywhere between a third of the timeout and three times it.

The implementation is chosen when this module is imported, as Triton itself decides at import
whether ``@triton.jit`` compiles or interprets: the interpreter's version calls plain Python,
which the compiler would refuse, and the compiled version uses inline PTX, which the
interpreter cannot run.
"""

import os
import time

import triton
import triton.language as tl

__all__ = ["clock_ns_lanes", "INTERPRETED"]

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _host_clock_ns() -> int:
    return time.monotonic_ns()


if INTERPRETED:

    @triton.jit
    def clock_ns_lanes(lanes):
        """Nanoseconds of the host's monotonic clock in every lane (interpreter only)."""
        return tl.zeros(lanes.shape, tl.int64) + _host_clock_ns()

else:

    @triton.jit
    def clock_ns_lanes(lanes):
        """Nanoseconds of the GPU's global timer, read by the thread of each lane; only differences
        are meaningful. ``lanes`` (int32) only gives the shape and layout: the asm ignores it."""
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l,r", [lanes], dtype=tl.int64, is_pure=False, pack=1
        )
