"""train_fsdp.py (FSDP2, fully_shard), launched for real under torchrun on gloo."""

import json

import pytest
from conftest import (
    EQUIVALENCE,
    assert_one_line_error,
    assert_same_math,
    launch,
    load_weights,
    mnist_args,
    python,
    succeeded,
    torchrun,
)


@pytest.mark.parametrize(
    "ranks, layout",
    [
        pytest.param(2, ["--sharding", "grad-op"], marks=pytest.mark.quick),
        pytest.param(
            4, ["--sharding", "hybrid", "--replicate-degree", "2"], marks=pytest.mark.slow
        ),
    ],  # -m slow
    ids=["grad-op-2", "hybrid-2x2"],  # full sharding: the AdamW test below
)
def test_sharded_training_matches_one_ddp_process_at_the_same_global_batch(
    ranks, layout, reference, control, mnist_dir, tmp_path
):
    # Built whole from the seed, then sharded, the model must start from DDP's initial weights and
    # follow the same 24 steps: global batch 32 in every case.
    path, metrics_path = tmp_path / "fsdp.pt", tmp_path / "metrics.json"
    batch = str(32 // ranks)
    run = torchrun(
        "train_fsdp.py",
        ranks,
        *mnist_args(mnist_dir),
        *EQUIVALENCE,
        "--batch-size",
        batch,
        *layout,
        "--save",
        path,
        "--metrics",
        metrics_path,
    )
    succeeded(run)
    assert_same_math(load_weights(path), reference, control)
    metrics = json.loads(metrics_path.read_text())
    assert metrics["global_batch_size"] == 32 and metrics["world_size"] == ranks
    assert metrics["mesh"] == ([2, 2] if "hybrid" in layout else [ranks])
    if (
        "grad-op" in layout
    ):  # and each rank holds half the training state, after the evaluation: in float64,
        # weights, gradients and SGD's momentum are 24 bytes a parameter on a DDP rank; BabyCNN's
        # rows split evenly
        per_rank = [r["state_bytes"] for r in metrics["ranks"]]
        assert per_rank == [24 * metrics["param_count"] // 2] * 2, (
            metrics["param_count"],
            per_rank,
        )


def test_full_sharding_with_adamw_matches_one_ddp_process_at_the_same_global_batch(
    mnist_dir, tmp_path
):
    # AdamW divides by the root of the squared gradients: where a gradient is near zero, another
    # summation order's rounding becomes a step of +-lr in float32. In float64 that rounding is
    # ~1e-16, and the runs end ~3e-15 apart.
    common = [*mnist_args(mnist_dir), *EQUIVALENCE, "--optimizer", "adamw", "--lr", "1e-3"]
    paths = {name: tmp_path / f"{name}.pt" for name in ("ddp", "fsdp", "control")}
    runs = [
        python("train_ddp.py", *common, "--batch-size", "32", "--save", paths["ddp"]),
        torchrun(
            "train_fsdp.py",
            2,
            *common,
            "--batch-size",
            "16",
            "--sharding",
            "full",
            "--save",
            paths["fsdp"],
        ),
        python("train_ddp.py", *common, "--batch-size", "16", "--save", paths["control"]),
    ]  # one rank's batch alone
    for run in runs:
        succeeded(run)
    assert_same_math(
        load_weights(paths["fsdp"]), load_weights(paths["ddp"]), load_weights(paths["control"])
    )


def test_bf16_mixed_precision_learns(mnist_dir, tmp_path):
    metrics_path = tmp_path / "metrics.json"
    run = torchrun(
        "train_fsdp.py",
        2,
        *mnist_args(mnist_dir),
        "--precision",
        "bf16",
        "--epochs",
        "3",
        "--batch-size",
        "32",
        "--warmup-steps",
        "5",
        "--metrics",
        metrics_path,
    )  # 30 steps in all
    succeeded(run)
    metrics = json.loads(metrics_path.read_text())
    assert metrics["precision"] == "bf16" and metrics["strategy"] == "fsdp"
    curve = [loss for _, loss, _ in metrics["loss_curve"]]
    assert curve[-1] < curve[0] / 2, curve
    assert metrics["test_accuracy"] > 0.5  # chance is 0.1
    assert run.output.count("epoch 3:") == 1 and "loss (all ranks)" in run.output


# case: (processes, flags, the error line it must give); one process where the world size does not
# matter
BAD_LAYOUTS = {
    "replicas-not-dividing": (
        2,
        ["--sharding", "hybrid", "--replicate-degree", "3"],
        "--replicate-degree 3 must be a positive divisor of the world size 2",
    ),
    "replicas-without-hybrid": (
        1,
        ["--sharding", "full", "--replicate-degree", "2"],
        "--replicate-degree applies to --sharding hybrid only",
    ),
    "cpu-offload-on-cpu": (1, ["--cpu-offload"], "--cpu-offload needs GPUs"),
}


@pytest.fixture(scope="module")
def bad_layout_runs():
    """Every bad layout, launched at once (each fails within seconds)."""
    return {
        case: launch("train_fsdp.py", ranks, "--dataset", "synthetic", *args)
        for case, (ranks, args, _) in BAD_LAYOUTS.items()
    }


@pytest.mark.parametrize("case", BAD_LAYOUTS)
def test_impossible_layouts_are_one_line_errors(case, bad_layout_runs):
    assert_one_line_error(bad_layout_runs[case].wait(), BAD_LAYOUTS[case][2])
