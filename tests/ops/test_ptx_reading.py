"""The TTGIR reading behind test_program_wait_decides_its_timeout_once_per_block (tests/support/
ptx_instructions.timer_facts), on small texts of the shapes Triton 3.9 prints: a branch on a raw
clock reading is seen, one on a block-wide reduction of it is told apart, and a loop whose index
has the name of a clock reading elsewhere (Triton names values after the source's variables) is
not taken for one."""

from __future__ import annotations

from ptx_instructions import narrow_products, timer_facts

_LAYOUT = "#blocked = #ttg.blocked<{sizePerThread = [1], threadsPerWarp = [32], warpsPerCTA = [8], order = [0]}>"
_READ = (
    '    %start = tt.elementwise_inline_asm "mov.u64 $0, %globaltimer;" {constraints = "=l,r", pure = false} '
    "%lanes : tensor<256xi32, #blocked> -> tensor<256xi64, #blocked>"
)


def test_a_branch_on_a_raw_reading_is_seen() -> None:
    ttgir = "\n".join(
        [
            _LAYOUT,
            _READ,
            "    %late = arith.cmpi sgt, %start, %deadline : tensor<256xi64, #blocked>",
            "    scf.if %late {",
        ]
    )
    assert timer_facts(ttgir) == {"per_thread": True, "branch_sees_raw": True, "branch_sees_reduced": False}


def test_a_branch_on_a_reduced_reading_is_told_apart() -> None:
    ttgir = "\n".join(
        [
            _LAYOUT,
            _READ,
            '    %latest = "tt.reduce"(%start) <{axis = 0 : i32}> ({',
            "    %late = arith.cmpi sgt, %latest, %deadline : i64",
            "    scf.if %late {",
        ]
    )
    assert timer_facts(ttgir) == {"per_thread": True, "branch_sees_raw": False, "branch_sees_reduced": True}


def test_a_loop_index_named_like_a_reading_is_no_reading() -> None:
    ttgir = "\n".join(
        [
            _LAYOUT,
            _READ,
            "    %cursor = scf.for %start = %c0_i64 to %body step %c2048_i64 iter_args(%acc = %zero) -> (i64) : i64 {",
            "    %more = arith.cmpi slt, %cursor, %total : i64",
            "    scf.if %more {",
        ]
    )
    assert timer_facts(ttgir)["branch_sees_raw"] is False


def test_a_32_bit_product_widened_into_an_address_is_found() -> None:
    ttgir = "\n".join(
        [
            "    %x_piece = arith.muli %start, %c4_i32 : i32 loc(#loc1)",
            "    %x_piece_44 = arith.extsi %x_piece : i32 to i64 loc(#loc1)",
            "    %x_piece_45 = arith.addi %x, %x_piece_44 : i64 loc(#loc1)",
            "    %wide = arith.extsi %start : i32 to i64",
            "    %y = arith.muli %wide, %c4_i64 : i64",
        ]
    )
    assert narrow_products(ttgir) == ["x_piece"]
