"""One process that runs the program kernel of a family on a workspace whose other ranks it plays
itself: their halves and flag areas are tensors of this process. Shared by
tests/gpu/test_program_kernels.py (CUDA tensors) and tests/ops/test_carried_programs.py (CPU
tensors: Triton's interpreter, the CUDA C++ kernels built for the host), so that the same tables
and launch run on both.
"""

from __future__ import annotations

import torch

from gpucomm.ops.launch_args import ProgramArgs
from gpucomm.ops.program import OPERAND_WORDS, RECORD_WORDS, WORDS, Builder, Program
from gpucomm.workspace.device_executor import channel_layout, instruction_rows, operand_rows

__all__ = ["HALF_BYTES", "Workspace", "tables"]

HALF_BYTES = 1 << 16


def tables(program: Program, channels: int, device: torch.device, by_size: bool = False, world: int = 1) -> dict:
    """The tables and launch constants a DeviceExecutor makes of ``program`` (its ``_prepare``
    and ``_bind``: the same module functions) for a launch among ``world`` ranks, on ``device``.
    The launch runs ``channels`` blocks unless ``by_size``."""

    def upload(rows: list[list[int]], width: int) -> torch.Tensor:
        return torch.tensor(rows or [[0] * width], dtype=torch.int64).reshape(-1).to(device)

    grid, granule = channel_layout(program, world, channels, by_size)
    return {
        "channels": grid,
        "granule": granule,
        "instructions": upload(instruction_rows(program), WORDS),
        "operands": upload(operand_rows(program, ()), OPERAND_WORDS),
        "copy_bytes": program.copy_bytes(),
        "aligned": program.aligned(),
    }


class Workspace:
    """What a DeviceExecutor hands the kernels, for ``world`` ranks whose halves and flag areas
    all live in this process: this process is rank 0, the test plays the others."""

    def __init__(self, device: torch.device, world: int, channels: int, half_bytes: int = HALF_BYTES) -> None:
        self.device, self.world, self.channels, self.half_bytes = device, world, channels, half_bytes
        self.halves = [torch.zeros(2 * half_bytes, dtype=torch.uint8, device=device) for _ in range(world)]
        # [sync flags: channels x world | poison | epoch of each channel] (the engine's layout
        # without the send/recv flags, which the program kernels never touch)
        self.flags = [
            torch.zeros(channels * world + 1 + channels, dtype=torch.int64, device=device) for _ in range(world)
        ]
        addrs = [h.data_ptr() for h in self.halves] + [f.data_ptr() for f in self.flags]
        self.peers = torch.tensor(addrs, dtype=torch.int64, device=device)
        self.state = self.flags[0][channels * world :]
        # Host memory the kernels write their error records to: pinned (mapped) where they run on a GPU.
        on_gpu = device.type == "cuda"
        self.record = torch.zeros(channels * RECORD_WORDS, dtype=torch.int64, pin_memory=on_gpu)

    def builder(self, name: str = "test") -> Builder:
        return Builder(0, self.world, self.half_bytes, name, ())

    def half(self, peer: int, which: int) -> torch.Tensor:
        """Bytes of half ``which`` (0 or 1) of rank ``peer`` (a view)."""
        return self.halves[peer][which * self.half_bytes :][: self.half_bytes]

    def run(self, kernels, program: Program, timeout_s: float = 10.0, by_size: bool = False) -> None:
        """One launch, waited for."""
        form = tables(program, self.channels, self.device, by_size, self.world)
        kernels.run_program(
            ProgramArgs(
                form["instructions"],
                form["operands"],
                self.peers,
                self.state.data_ptr(),
                self.record.data_ptr(),
                channels=form["channels"],
                all_channels=self.channels,
                rank=0,
                world=self.world,
                fingerprint=program.fingerprint,
                half_bytes=self.half_bytes,
                granule=form["granule"],
                timeout_ns=int(timeout_s * 1e9),
                dtype=program.dtype,
                op=int(program.op or 0),
                copy_bytes=form["copy_bytes"],
                aligned=form["aligned"],
            )
        )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def flag(self, owner: int, channel: int, writer: int) -> torch.Tensor:
        """Channel ``channel``'s flag that ``writer`` writes, in ``owner``'s flag area (a view)."""
        i = channel * self.world + writer
        return self.flags[owner][i : i + 1]

    def epochs(self) -> list[int]:
        return self.state[1:].tolist()

    def poisoned(self) -> bool:
        return bool(self.state[0].item())

    def records(self) -> list[list[int]]:
        return self.record.view(self.channels, RECORD_WORDS).tolist()
