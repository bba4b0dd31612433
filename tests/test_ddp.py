"""train_ddp.py and run_ddp.sh, launched for real under torchrun on gloo."""

import csv
import json
import os
import shutil

import pytest
import torch
from conftest import (
    EQUIVALENCE,
    ROOT,
    Run,
    assert_same_math,
    child_env,
    free_port,
    launcher_env,
    load_weights,
    max_difference,
    mnist_args,
    python,
    succeeded,
    torchrun,
)

from benchmarks.compare import steady_state
from models import BabyCNN


@pytest.fixture(scope="module")
def two_ranks(mnist_dir, tmp_path_factory):
    """Two ranks at batch 16 each (global batch 32)."""
    path = tmp_path_factory.mktemp("ddp") / "two_ranks.pt"
    succeeded(
        torchrun(
            "train_ddp.py",
            2,
            *mnist_args(mnist_dir),
            *EQUIVALENCE,
            "--batch-size",
            "16",
            "--save",
            path,
        )
    )
    return load_weights(path)


def test_saved_weights_load_into_a_plain_babycnn_and_moved_away_from_the_initial_ones(
    reference, reference_run, reference_metrics
):
    # --max-grad-norm 1 clipped the steps the run logged (every layout's equivalence checks clipping
    # too)
    assert [step for step, _ in reference_metrics["grad_norms"]] == [8, 16, 20, 24]
    assert all(norm > 1.1 for _, norm in reference_metrics["grad_norms"]), reference_metrics[
        "grad_norms"
    ]
    umask = os.umask(0)
    os.umask(umask)
    assert (
        reference_run / "reference.pt"
    ).stat().st_mode & 0o777 == 0o666 & ~umask  # readable as open() makes files
    model = BabyCNN(in_channels=1, num_classes=10, image_size=28)
    model.load_state_dict(reference)  # strict: no "module." prefix, no missing or extra keys
    torch.manual_seed(0)
    initial = BabyCNN(in_channels=1, num_classes=10, image_size=28).state_dict()
    assert max_difference(reference, initial) > 0.01  # training really moved the weights


@pytest.mark.quick
def test_two_ranks_match_one_process_at_twice_the_batch(reference, two_ranks, control):
    assert_same_math(two_ranks, reference, control)


def test_gradient_accumulation_matches_one_process_at_twice_the_batch(
    reference, control, mnist_dir, tmp_path
):
    path = tmp_path / "accumulated.pt"
    run = python(
        "train_ddp.py",
        *mnist_args(mnist_dir),
        *EQUIVALENCE,
        "--batch-size",
        "16",
        "--grad-accum",
        "2",
        "--save",
        path,
    )
    succeeded(run)
    assert "global batch 32" in run.output
    assert_same_math(load_weights(path), reference, control)


def two_nodes(tmp_path, mnist_dir, with_data, *args, **extra_env):
    """Start run_ddp.sh as two "nodes" of one process each, each in its own directory, reading
    --data-dir data there (no shared filesystem): node k gets a copy of the MNIST files if
    with_data[k]."""
    port, runs = free_port(), []
    for node_rank in (0, 1):
        node_dir = tmp_path / f"node{node_rank}"
        node_dir.mkdir()
        if with_data[node_rank]:
            shutil.copytree(mnist_dir, node_dir / "data")
        env = launcher_env(
            NNODES=2,
            NODE_RANK=node_rank,
            NPROC_PER_NODE=1,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            RDZV_ID=f"test-{port}",
            **extra_env,
        )
        runs.append(
            Run(
                ["bash", ROOT / "run_ddp.sh", "--data-dir", "data", "--no-download", *args],
                env=env,
                cwd=node_dir,
            )
        )
    return runs


@pytest.mark.slow  # in CI's slow stage, for the README's 8 minutes
def test_two_nodes_with_their_own_data_train_like_one_node_with_two_processes(
    two_ranks, mnist_dir, tmp_path
):
    path = tmp_path / "two_nodes.pt"
    nodes = two_nodes(
        tmp_path,
        mnist_dir,
        (True, True),
        "--dataset",
        "mnist",
        *EQUIVALENCE,
        "--batch-size",
        "16",
        "--save",
        path,
    )
    for node in nodes:
        succeeded(node)
    assert "DDP on 2 rank(s)" in nodes[0].output + nodes[1].output
    assert max_difference(load_weights(path), two_ranks) == 0  # the very same computation


@pytest.mark.slow  # in CI's slow stage, for the README's 8 minutes
def test_a_node_without_the_files_stops_every_node(mnist_dir, tmp_path):
    metrics_path = tmp_path / "metrics.json"
    nodes = two_nodes(
        tmp_path,
        mnist_dir,
        (True, False),
        "--dataset",
        "mnist",
        "--max-steps",
        "40",
        "--metrics",
        metrics_path,
        MAX_RESTARTS=0,
    )
    for node in nodes:
        node.wait()
    output = nodes[0].output + nodes[1].output
    lacking = f"is not in {tmp_path / 'node1' / 'data'} on node "
    # One line, from rank 0, whichever node it is on, naming the node without the files.
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and lacking in errors[0] and "on every node" in errors[0], output
    assert all(node.returncode != 0 for node in nodes)


def test_short_run_learns_with_all_reduced_loss_and_metrics(mnist_dir, tmp_path):
    metrics_path = tmp_path / "metrics.json"
    run = torchrun(
        "train_ddp.py",
        2,
        "--dataset",
        "mnist",
        "--data-dir",
        mnist_dir,
        "--no-download",
        "--epochs",
        "10",
        "--batch-size",
        "32",
        "--lr",
        "1e-3",
        "--scale-lr",
        "--base-batch-size",
        "32",
        "--metrics",
        metrics_path,
        "--log-dir",
        tmp_path / "log",
        "--profile-steps",
        "52:53",
    )
    succeeded(run)
    metrics = json.loads(metrics_path.read_text())
    assert metrics["dataset"] == "mnist"
    assert metrics["world_size"] == 2 and metrics["global_batch_size"] == 64
    assert metrics["peak_lr"] == pytest.approx(2e-3)  # linear scaling rule: 1e-3 * 64 / 32
    # 100 steps: the default warmup is a fifth of them, not 100 (which would leave the lr below its
    # peak throughout)
    assert "peak lr 0.002 after 20 warmup steps;" in run.output, run.output
    assert metrics["steps"] == 10 * (640 // 2 // 32)
    curve = [loss for _, loss, _ in metrics["loss_curve"]]
    assert curve[-1] < curve[0] / 3, curve
    assert metrics["test_accuracy"] > 0.7  # chance is 0.1
    assert metrics["samples_per_second"] > 0 and metrics["final_train_loss"] == curve[-1]
    # Each curve point holds the training seconds so far, from which benchmarks/compare.py takes the
    # steady state: from the first logging point past a tenth of the 100 steps (step 20) to the end.
    seconds = [s for _, _, s in metrics["loss_curve"]]
    assert (
        0 < seconds[0] and seconds == sorted(seconds) and seconds[-1] <= metrics["train_seconds"]
    ), seconds
    steady_from, steady_rate = steady_state(metrics, log_every=20)
    assert steady_from == 20 and steady_rate > 0
    # Every rank holds everything: weights + gradients + two AdamW moments = 4 x the parameters.
    assert [r["rank"] for r in metrics["ranks"]] == [0, 1]
    for record in metrics["ranks"]:
        assert record["state_bytes"] == pytest.approx(4 * 4 * metrics["param_count"], rel=0.01)
        assert record["peak_memory_bytes"] > 0
    # FLOPs counted on the real model (FlopCounterMode): BabyCNN's forward is 2,330,048
    # multiply-accumulates (the convolutions' weights x their 28x28, 14x14, 7x7 outputs, and the
    # classifier), 2 FLOPs each; backward computes the weights' gradients (as many) and every
    # input's but the image's (less the first convolution's 56,448 x 2).
    forward = 2 * 2_330_048
    assert (
        metrics["flops_per_sample"] == 2 * forward + forward - 2 * 56_448 and metrics["mfu"] is None
    )  # no GPU
    assert metrics["flops_per_second"] == pytest.approx(
        metrics["flops_per_sample"] * metrics["samples_per_second"]
    )
    assert "; 13.9 MFLOPs a sample;" in run.output
    # Only rank 0 talks, once per epoch, and the loss says it is all-reduced; in a pipe, in lines
    # (no bar redrawn).
    assert run.output.count("epoch 1:") == 1 and run.output.count("epoch 10:") == 1
    assert "\r" not in run.output and "step 100/100: loss (all ranks)" in run.output
    # --log-dir: a CSV row per logging step, then per evaluation; --profile-steps 52:53: each rank's
    # trace of two steps (no logging step, no epoch end), in which only DDP's bucket all-reduce
    # runs: one a step (one bucket)
    with open(tmp_path / "log" / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert [(int(r["step"]), float(r["train_loss"])) for r in rows if r["train_loss"]] == [
        (step, loss) for step, loss, _ in metrics["loss_curve"]
    ]
    assert sum(1 for r in rows if r["test_accuracy"]) == 10
    for rank in (0, 1):
        events = json.loads((tmp_path / "log" / f"trace-rank{rank}.json").read_text())[
            "traceEvents"
        ]
        assert sum(e.get("name") == "gloo:all_reduce" for e in events) == 2, rank
    assert "loss (all ranks)" in run.output and "[rank1]" not in run.output


def test_bf16_autocast_trains(mnist_dir, tmp_path):
    metrics_path = tmp_path / "metrics.json"
    run = python(
        "train_ddp.py",
        *mnist_args(mnist_dir),
        "--precision",
        "bf16",
        "--batch-size",
        "32",
        "--max-steps",
        "30",
        "--log-every",
        "10",
        "--metrics",
        metrics_path,
    )
    succeeded(run)
    metrics = json.loads(metrics_path.read_text())
    assert metrics["precision"] == "bf16"
    curve = [loss for _, loss, _ in metrics["loss_curve"]]
    assert all(loss == loss for loss in curve) and curve[-1] < curve[0], curve


def test_an_error_after_a_torchrun_restart_is_printed_with_its_attempt(mnist_dir):
    # torchrun tells a restarted worker its attempt in TORCHELASTIC_RESTART_COUNT; a restart can
    # fail where the first attempt did not, so every attempt says its error, and which attempt it
    # was.
    for flags in (
        ["--batch-size", "0"],
        ["--dataset", "mnist", "--no-download", "--data-dir", mnist_dir / "missing"],
    ):
        run = python("train_ddp.py", *flags, env=child_env(TORCHELASTIC_RESTART_COUNT=1)).wait()
        errors = [line for line in run.output.splitlines() if line.startswith("error:")]
        assert (
            run.returncode == 2 and len(errors) == 1 and errors[0].endswith("(torchrun restart 1)")
        ), run.output
