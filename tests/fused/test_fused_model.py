"""The model's prediction for gpucomm.fused (bench/fused_model.py) and the choices taken from it."""

from __future__ import annotations

from gpucomm._bench import fused_model
from gpucomm.fused import _norm


def test_the_two_shot_threshold_is_the_models_crossover() -> None:
    args = fused_model._args([])
    sweep = fused_model.rmsnorm_rows(args, tokens=tuple(2**i for i in range(10)))
    ahead = [
        r["tokens"]
        for r in sweep
        if r["tokens"] >= args.world
        and all(q["fused_twoshot_us"] < q["fused_us"] for q in sweep if q["tokens"] >= r["tokens"])
    ]
    assert ahead and ahead[0] * fused_model.HIDDEN * 2 == _norm.TWO_SHOT_MIN_BYTES == fused_model.TWO_SHOT_MIN_BYTES


def test_the_fused_norm_is_predicted_ahead_of_the_unfused_calls_and_the_gather_mostly_hidden() -> None:
    args = fused_model._args([])
    for row in fused_model.rmsnorm_rows(args):
        assert row["fused_auto_us"] < row["unfused_us"], row
    ag = fused_model.ag_matmul(args, **fused_model.LLAMA70B_AG)
    assert ag["fused_us"] < ag["unfused_us"] and 0 < ag["hidden_fraction"] <= 1, ag
