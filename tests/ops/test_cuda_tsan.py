"""A race finder for the flags protocol: small.cu's all_reduce with its ranks as threads of one
process, built with ThreadSanitizer.

Each rank is an OS thread that launches ``gpucomm_small_sum_float32`` over the others' halves and
flag areas (2 channels, 64 threads a block, 3 ranks, several calls in a row so that the halves
alternate and are reused). The shim's flag accesses are ``__atomic`` loads and stores with the
orders the CUDA code declares (acquire, release), and a block barrier synchronises the block's
fibers, so TSan checks the memory-ordering contract as written (docs/kernel-contract.md): a rank
that reads a peer's staged data must be ordered after the peer wrote it by the flags alone. A flag
released before the barrier that orders the block's copy-in is a data race TSan reports, whatever
x86's own ordering would have let pass. Skipped where the compiler cannot build with
``-fsanitize=thread``.
"""

from __future__ import annotations

import pathlib
import subprocess
import tempfile

import pytest

from gpucomm.ops import cuda_host, instruction_set

HARNESS = r"""
#include "host_shim.h"
#include "small.cu"

#include <thread>

GPUCOMM_HOST_KERNELS(GPUCOMM_HOST_KERNEL(gpucomm_small_sum_float32))

constexpr int WORLD = 3, CHANNELS = 2, THREADS = 64, N = 1000, CALLS = 4;
constexpr long long HALF = 4096;  // bytes of one half: N floats fit

struct alignas(16) Rank {
    unsigned char halves[2 * HALF];
    // The flags (channel, writer), then the identity slots (epoch parity, channel, writer) of
    // GPUCOMM_IDENT_WORDS words each, as gpucomm.workspace.layout.FlagLayout lays them out.
    long long flags[CHANNELS * WORLD + 2 * CHANNELS * WORLD * GPUCOMM_IDENT_WORDS];
    long long state[1 + CHANNELS];
    long long record[CHANNELS * GPUCOMM_RECORD_WORDS];
    float x[N];
};

static Rank ranks[WORLD];
static int wrong[WORLD];

static void run(int rank) {
    for (int call = 0; call < CALLS; ++call) {
        for (int i = 0; i < N; ++i) ranks[rank].x[i] = (float)(rank * 1000 + i + call);
        unsigned long long words[30];
        int w = 0;
        words[w++] = (unsigned long long)ranks[rank].x;
        words[w++] = N;
        for (int p = 0; p < 8; ++p) words[w++] = p < WORLD ? (unsigned long long)ranks[p].halves : 0;
        for (int p = 0; p < 8; ++p) words[w++] = p < WORLD ? (unsigned long long)ranks[p].flags : 0;
        words[w++] = HALF;
        words[w++] = (unsigned long long)ranks[rank].state;
        words[w++] = (unsigned long long)ranks[rank].record;
        words[w++] = rank;
        words[w++] = WORLD;
        words[w++] = 7;                // fingerprint
        words[w++] = 20000000000ull;   // timeout_ns: 20 s
        words[w++] = CHANNELS;
        words[w++] = WORLD;            // divisor
        words[w++] = CHANNELS * WORLD; // ident_word: the first identity slot
        words[w++] = 5;                // the call's identity words, the same on every rank
        words[w++] = 9;
        void* params[30];
        for (int i = 0; i < w; ++i) params[i] = &words[i];
        if (gpucomm_host_launch("gpucomm_small_sum_float32", CHANNELS, THREADS, params, 0) != 0) std::abort();
        for (int i = 0; i < N; ++i) {
            float want = 0;
            for (int p = 0; p < WORLD; ++p) want += (float)(p * 1000 + i + call);
            if (ranks[rank].x[i] != want) ++wrong[rank];
        }
        if (ranks[rank].record[0] != 0) ++wrong[rank];
    }
}

int main() {
    std::thread threads[WORLD];
    for (int r = 0; r < WORLD; ++r) threads[r] = std::thread(run, r);
    for (auto& t : threads) t.join();
    for (int r = 0; r < WORLD; ++r) {
        if (wrong[r]) {
            std::fprintf(stderr, "rank %d: %d wrong results\n", r, wrong[r]);
            return 1;
        }
    }
    std::puts("ok");
    return 0;
}
"""


def _build(folder: pathlib.Path) -> pathlib.Path | str:
    source = folder / "tsan_small.cpp"
    source.write_text(HARNESS)
    binary = folder / "tsan_small"
    defines = [f"-D{k}={v}" for k, v in sorted(instruction_set.cuda_defines().items())]
    command = [
        cuda_host.compiler(),
        "-std=c++17",
        "-O1",
        "-g",
        "-fsanitize=thread",
        "-ffp-contract=off",
        "-Wno-unknown-pragmas",
        f"-I{cuda_host._source_dir()}",
        *defines,
        "-DGPUCOMM_THREADS=64",
        str(source),
        "-o",
        str(binary),
        "-pthread",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    return binary if done.returncode == 0 else done.stderr


def test_the_flags_protocol_has_no_data_race_under_thread_sanitizer() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        built = _build(pathlib.Path(tmp))
        if isinstance(built, str):
            pytest.skip(f"no ThreadSanitizer build here: {built[-500:]}")
        done = subprocess.run(
            [str(built)], capture_output=True, text=True, timeout=600, env={"TSAN_OPTIONS": "halt_on_error=1"}
        )
    assert "ThreadSanitizer" not in done.stderr, done.stderr[-6000:]
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr[-3000:]
