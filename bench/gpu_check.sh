#!/usr/bin/env bash
# The GPU check for a lent GPU machine, in parts that each end well inside a 10-minute call
# (see ../docs/benchmarks.md and docs/results/). Run from the repository root:
#
#   bash bench/gpu_check.sh brief     # for a 15-minute lease: tests/gpu, all_reduce at 2 ranks beside gloo and NCCL, eager latency bound
#   bash bench/gpu_check.sh bench2    # kernel roofline, collectives at 2 ranks beside gloo, latency, launches
#   bash bench/gpu_check.sh bench4    # collectives at 4 ranks beside gloo, every algorithm forced
#   bash bench/gpu_check.sh latency   # 8-byte all_reduce at 2 ranks, eager (bound launch, JIT beside it) and from a CUDA graph
#   bash bench/gpu_check.sh symmetric # all_reduce of symmetric tensors (gpucomm.empty) against ordinary ones, multimem on and off
#   bash bench/gpu_check.sh fused     # gpucomm.fused against the unfused calls (checked, timed), the device API's tests
#   bash bench/gpu_check.sh breakdown # where the captured all_reduce's device time goes (steps left out), a REDUCE by channels, pull vs push
#   bash bench/gpu_check.sh tests-a   # tests/gpu, first of two calls: the kernel files, then the rank files that check fixes
#   bash bench/gpu_check.sh tests-b   # tests/gpu, second call: graph replays and timeouts, workspace collectives, fused, DDP
#   bash bench/gpu_check.sh sanitize-memcheck   # every collective at 2 ranks under compute-sanitizer,
#   bash bench/gpu_check.sh sanitize-racecheck  # one-shot and two-shot all_reduce forced, Triton and
#   bash bench/gpu_check.sh sanitize-synccheck  # CUDA C++ kernels: the tool's verdict per run
#   bash bench/gpu_check.sh cpu       # the CPU suite's fast files on this machine's torch and triton
#   bash bench/gpu_check.sh cpuhost-default  # the CPU path on this host's many cores (DDP overlap, all_reduce beside
#   bash bench/gpu_check.sh cpuhost-1        # gloo), with torch's default threads and with one
#
# A lent session has about 15 minutes of device time in all, the machine's start (a minute or two)
# included, and no machine starts with under 4 minutes left: not enough for every part. Run `brief`
# first, in one call (at most 500 s of steps); then, while the machine is still warm, `breakdown`
# (280 s); later sessions take tests-a, tests-b, latency and bench2, then sanitize-memcheck, then the
# others.
#
# Every part installs gpucomm first (kernels/ and bench/ exist as gpucomm._kernels and
# gpucomm._bench only after an install), starts MPS if it can and stops it on exit, runs each step
# under `timeout`, and packs its logs and JSON into one archive $OUT/<part>.tar.gz (the device tool
# brings back at most 8 files). A short summary is printed last.
set -uo pipefail
part=${1:?usage: bash bench/gpu_check.sh brief|bench2|bench4|latency|symmetric|fused|breakdown|tests-a|tests-b|sanitize-memcheck|sanitize-racecheck|sanitize-synccheck|cpu|cpuhost-default|cpuhost-1}
out=${OUT:-gpu-check-out}
work=$(mktemp -d)
export PYTHONUNBUFFERED=1
status=0
summary=()

step() {  # step NAME SECONDS COMMAND...: run under timeout, log to $work/NAME.log, note the outcome
    local name=$1 limit=$2
    shift 2
    # SIGINT first: pytest then prints its summary of what failed so far, Python a traceback.
    timeout --signal=INT --kill-after=15 "$limit" "$@" >"$work/$name.log" 2>&1
    local rc=$?
    summary+=("$name: exit $rc$([ $rc -ge 124 ] && echo " (timed out after ${limit}s)")")
    [ $rc -eq 0 ] || status=1
    tail -n 5 "$work/$name.log"
}

finish() {
    [ "${mps:-off}" = on ] && echo quit | nvidia-cuda-mps-control
    mkdir -p "$out"
    tar -czf "$out/$part.tar.gz" -C "$work" .
    printf '%s\n' "--- gpu_check $part" "${summary[@]}"
}
trap finish EXIT

python3 -m pip install -q --no-deps --no-build-isolation -e . >"$work/install.log" 2>&1 || { echo "install failed"; cat "$work/install.log"; exit 1; }
{
    nvidia-smi -L
    python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    python3 -c "import cupy; print('cupy', cupy.__version__)" || echo "cupy: not importable"
} >"$work/versions.txt" 2>&1

# MPS lets the ranks' kernels run at the same time on the one GPU; without it they take turns.
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
# The sanitizer parts run without it: a verdict needs no concurrency, and whether the tool
# works under MPS on these machines is not known (a failed run would cost a part).
mps=off
if [[ $part != sanitize-* ]] && nvidia-cuda-mps-control -d 2>>"$work/versions.txt"; then
    # The daemon can start and still refuse clients (in a container without its IPC namespace):
    # probe with one CUDA allocation in a fresh process, and fall back to no MPS if it fails.
    if timeout 60 python3 -c "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()" >>"$work/versions.txt" 2>&1; then
        mps=on
    else
        echo quit | nvidia-cuda-mps-control
        echo "MPS: the daemon started but a CUDA client failed under it; running without MPS" >>"$work/versions.txt"
    fi
fi
echo "MPS: $mps" >>"$work/versions.txt"
cat "$work/versions.txt"

bench="python3 -m gpucomm._bench.cli"  # a command, not a function: `timeout` runs it
main4="all_reduce all_gather reduce_scatter broadcast"
case $part in
brief)
    # One call of a 15-minute lease (a minute or two of it goes to starting the machine): does it
    # work at all, and the bandwidth at 2 ranks, each step bounded so the archive comes back. No
    # -x: one failure must not hide the others; pytest-timeout (there on the lent image) ends a
    # hung test instead of the step. The single-process kernel files and the benchmark run before
    # the files that spawn ranks: ranks a test's timeout kills leave the GPU busy for a while
    # under MPS (an H100 run, 2026-11-25: the next step's CUDA calls failed "busy or unavailable").
    # 120 s a test: the graph-timeout tests wait out a collective timeout, the fused test compiles
    # several kernels (30 s cut both short on an H100, 2026-11-25).
    per_test=""; python3 -c "import pytest_timeout" 2>/dev/null && per_test="--timeout=120"
    # The kernels' files are single-process and mostly compile time (1131 cases): spread them over
    # the host's cores where pytest-xdist is there. 4 workers ran 674 of them in 70 s on a 16-core
    # H100 host (2026-11-25); 8 leave a core each to the compiler and to CUDA's own threads.
    workers=""; python3 -c "import xdist" 2>/dev/null && workers="-n 8"
    kernel_files="tests/gpu/test_cuda_kernels.py tests/gpu/test_program_kernels.py"
    # First, whether launches through CuPy's Function and through gpucomm's launcher run in order
    # on torch's stream (2026-11-25's three unexplained results were all CuPy's): a few seconds.
    order="in_order_on_torchs_current_stream or times_out_with_the_missing"
    step tests_gpu_launch_order 40 python3 -m pytest tests/gpu/test_cuda_kernels.py -k "$order" -v -p no:cacheprovider $per_test -rfE --tb=short
    step tests_gpu_kernels 70 python3 -m pytest $kernel_files -k "not ($order)" -q -p no:cacheprovider $per_test $workers -rfE --tb=short
    # NCCL beside it where the installed NCCL takes two ranks on one GPU (2.30 and later); otherwise
    # the table prints NCCL's refusal and version, at no cost (bench/backends.py).
    step all_reduce_np2 80 $bench all_reduce --nproc 2 -b 8 -e 256M -f 16 --compare gloo,nccl --json "$work/all_reduce_np2.json"
    # The eager call's host time beside a plain torch launch's (torch_launch_host_us) and a bare
    # launch through gpucomm's launcher (launcher_host_us), with each kernel family: what of the
    # bound call's host time is the driver's launch and what is gpucomm's.
    for k in triton cuda; do
        step "gpu_latency_${k}_bound" 50 python3 -m gpucomm._bench.gpu_latency --nproc 2 --kernels "$k" --launch bound --rounds 3 --json "$work/gpu_latency_${k}_bound.json"
    done
    # The files that spawn ranks, in the order they most need a GPU: those that check fixes made
    # without one, then those that have never run on one, then the rest; DDP (28 of its 30 cases
    # passed on an H100, 2026-11-25) last. pytest runs files in the order named.
    rank_files="test_repeat_launch_gpu test_small_allreduce_gpu test_all_reduce_into_gpu test_async_gpu test_caller_stream_gpu test_symmetric_gpu
        test_workspace_collectives_gpu test_stream_ordered_gpu test_fused_gpu test_program_cache_gpu test_cuda_ipc
        test_bench_timing_gpu test_ddp_gpu"
    step tests_gpu_ranks 170 python3 -m pytest $(printf 'tests/gpu/%s.py ' $rank_files) -q -p no:cacheprovider $per_test \
        -rfE --tb=short --durations=10
    grep -hE "^(FAILED|ERROR) " "$work"/tests_gpu_*.log | cut -c1-200 | sort | uniq | head -60
    ;;
bench2)
    # Step limits add up to 570 s: with the install and MPS, one call of at most 600 s.
    step kernels 110 $bench kernels -b 4K -e 256M -f 4 --json "$work/kernels.json"
    # The same kernels captured into CUDA graphs: the device's time at the small sizes, where the
    # per-call events above hold the host's enqueue (H100, 2026-11-25: 22-140 us per call).
    step kernels_graph 50 $bench kernels -b 4K -e 16M -f 4 -G 5 --json "$work/kernels_graph.json"
    for c in $main4; do
        step "${c}_np2" 75 $bench "$c" --nproc 2 -b 8 -e 256M -f 4 --compare gloo --json "$work/${c}_np2.json"
    done
    step latency_np2 40 $bench all_reduce --nproc 2 -b 8 -e 64K -f 2 -n 200 -w 20 --rounds 3 --compare gloo --json "$work/latency_np2.json"
    step latency_np2_graph 30 $bench all_reduce --nproc 2 -b 8 -e 64K -f 2 -n 100 -w 20 --rounds 3 -G 10 --json "$work/latency_np2_graph.json"
    step launches 40 python3 -m gpucomm._bench.launches --nproc 2 --json "$work/launches.json"
    ;;
bench4)
    for c in $main4; do
        step "${c}_np4" 100 $bench "$c" --nproc 4 -b 8 -e 256M -f 4 --compare gloo --json "$work/${c}_np4.json"
    done
    for algo in oneshot twoshot ring tree; do
        step "all_reduce_${algo}_np4" 60 $bench all_reduce --nproc 4 -b 8 -e 64M -f 8 --algo "$algo" --json "$work/all_reduce_${algo}_np4.json"
    done
    step nccl_np2 30 $bench all_reduce --nproc 2 -b 8 -e 8K -f 8 --backend nccl   # NCCL refuses two ranks on one GPU
    ;;
latency)
    # The eager latency through gpucomm's launcher (bound) and, beside it, through Triton's JIT
    # dispatch or CuPy's Function (jit), side by side.
    for k in triton cuda; do
        for launch in bound jit; do
            step "gpu_latency_${k}_$launch" 180 python3 -m gpucomm._bench.gpu_latency --nproc 2 --kernels "$k" --launch "$launch" --json "$work/gpu_latency_${k}_$launch.json"
        done
    done
    ;;
symmetric)
    # 8 B to 64 MiB at 2 ranks, the program kernel (Triton, then CUDA C++): ordinary, symmetric,
    # two-shot forced on both (in place on the symmetric one at every size). The multimem step adds
    # NVLink SHARP where the engine has it; on one GPU shared by the ranks it prints the one-line
    # reason instead (a multicast object takes each GPU once), as does a heap without cuda.bindings.
    for k in triton cuda; do
        step "symmetric_${k}_np2" 200 python3 -m gpucomm._bench.symmetric --nproc 2 --device cuda --kernels "$k" --json "$work/symmetric_${k}_np2.json"
    done
    step symmetric_multimem_np2 150 python3 -m gpucomm._bench.symmetric --nproc 2 --device cuda --kernels triton --multimem --json "$work/symmetric_multimem_np2.json"
    ;;
fused)
    # gpucomm.fused and the one-shot written with gpucomm.language on CUDA tensors at 2 ranks: the
    # CPU tests' comparisons on the GPU first (bits of the fused norm, the matmul within tolerance),
    # then the timed pairs of bench/fused.py, each checked (fused AR+residual+RMSNorm at 1, 32 and
    # 256 tokens of 8192 bf16 against all_reduce + residual_rmsnorm, bit for bit; all_gather_matmul
    # of 512 x 8192 shards times 8192 x 3584 against all_gather + matmul; the one-shot written with
    # the API against the program kernel's at 4, 4096 and 32768 elements, bit for bit), then the
    # tutorial as written.
    step fused_tests 240 python3 -m pytest tests/gpu/test_fused_gpu.py -q -p no:cacheprovider -x
    step fused_np2 240 python3 -m gpucomm._bench.fused --nproc 2 --device cuda --json "$work/fused_np2.json"
    step tutorial_np2 90 python3 -m torch.distributed.run --nproc-per-node 2 docs/tutorials/one_shot_all_reduce.py
    ;;
breakdown)
    # Two ranks on the one GPU, each kernel family: the 8 B and 64 KiB all_reduce's program with its
    # REDUCEs, COPYs or SYNCs left out and with nothing to move (launch), captured into CUDA graphs;
    # one REDUCE over the peer's half at 1, 4, 16 and 32 channels, 1 to 256 MiB; a COPY pulled from
    # the peer's half against one pushed into it. Every full program and REDUCE/COPY checked; its log
    # ends with the model's flags this run measured and the check (bench/breakdown.py). Limits: 280 s.
    # Without MPS a SYNC waits for the peer's time slice: fewer rounds, so the SYNC variants' replays fit.
    rounds=5; [ "$mps" = on ] || rounds=3
    for k in triton cuda; do
        limit=150; [ "$k" = cuda ] && limit=130
        step "breakdown_$k" "$limit" python3 -m gpucomm._bench.breakdown --nproc 2 --kernels "$k" --mps "$mps" \
            --rounds "$rounds" --json "$work/breakdown_$k.json"
    done
    ;;
tests-a|tests-b)
    # Every case of tests/gpu in one step of tests-a or tests-b (bench/gpu_test_parts.py names the
    # steps, their limits from the 2026-11-25 H100 run's durations, and their cases; a CPU test
    # checks each case is named once). No -x: one failure must not hide the others; pytest-timeout
    # (there on the lent image) ends a hung test instead of the step.
    per_test=""; python3 -c "import pytest_timeout" 2>/dev/null && per_test="--timeout=120"
    mapfile -t steps < <(python3 -m gpucomm._bench.gpu_test_parts "$part")
    [ ${#steps[@]} -gt 0 ] || { echo "no steps for $part"; exit 1; }
    for line in "${steps[@]}"; do
        eval "set -- $line"  # name, limit, then pytest's arguments, quoted by shlex.join
        name=$1 limit=$2
        shift 2
        step "$name" "$limit" python3 -m pytest "$@" -q -p no:cacheprovider $per_test -rfE --tb=short --durations=15
    done
    grep -hE "^(FAILED|ERROR) " "$work"/tests_gpu_*.log | cut -c1-200 | sort | uniq | head -60
    ;;
sanitize-memcheck|sanitize-racecheck|sanitize-synccheck)
    # `all` runs every collective (all_gather and broadcast among them) with checked results;
    # --algo forces all_reduce's algorithm and leaves the others their own. Ranks are child
    # processes: --target-processes all. A reported error exits 99, a hang ends at the timeout.
    tool=${part#sanitize-}
    for k in triton cuda; do
        for a in oneshot twoshot; do
            step "${tool}_${k}_${a}" 130 compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 99 \
                --print-limit 20 $bench all --nproc 2 -b 4K -e 64K -f 16 -n 1 -w 1 --transport cuda_ipc --kernels "$k" --algo "$a" --timeout 60
        done
    done
    ;;
cpu)
    # On a GPU image with Triton 3.6 the files that interpret the program kernel (test_instruction_set,
    # test_stream_ordered_kernel) fail in Triton's interpreter, not in gpucomm (docs/results/2026-11-25-h100.md).
    step tests_cpu 540 python3 -m pytest -q -p no:cacheprovider tests/ops/test_instruction_set.py tests/workspace/test_stream_ordered_kernel.py \
        tests/ops/test_cpu_kernels.py tests/ops/test_cuda_compile.py tests/ops/test_triton_aot.py tests/distributed/test_signatures.py
    ;;
cpuhost-default|cpuhost-1)
    # The 2-core CI machine has no core free beside a rank's backward pass, so whether the
    # asynchronous DDP hook overlaps on the shared-memory path can only be seen on a host like this
    # one. cpuhost-default: torch's default threads (what a newcomer gets; OMP_NUM_THREADS removed);
    # cpuhost-1: one thread (torchrun's). Ranks unbound either way.
    if [ "$part" = cpuhost-default ]; then run="env -u OMP_NUM_THREADS"; else run="env OMP_NUM_THREADS=1"; fi
    step ddp_overlap 150 $run python3 -m gpucomm._bench.ddp_overlap --nproc 2 --rounds 5 --steps 8 --json "$work/ddp_overlap.json"
    step async_return 60 $run python3 -m gpucomm._bench.async_return --nproc 2 --size 32M --rounds 5 --json "$work/async_return.json"
    for np in 2 4; do
        step "cpu_all_reduce_np$np" 150 $run $bench all_reduce --nproc $np -b 8 -e 64M -f 4 --compare gloo --rounds 3 -n 10 -w 3 --bind none --device cpu --json "$work/cpu_all_reduce_np$np.json"
    done
    ;;
*)
    echo "unknown part: $part (brief|bench2|bench4|latency|symmetric|fused|breakdown|tests-a|tests-b|sanitize-memcheck|sanitize-racecheck|sanitize-synccheck|cpu|cpuhost-default|cpuhost-1)" >&2
    exit 2
    ;;
esac
exit $status
