"""train_ddp.py and run_ddp.sh, launched for real under torchrun on gloo."""

import json
import os
import signal
import time

import pytest
import torch

from conftest import (
    EQUIVALENCE, ROOT, TOLERANCE, Run, assert_one_line_error, launcher_env, worker_pids, free_port, load_weights, max_difference, mnist_args, python, succeeded, torchrun,
)
from models import BabyCNN

@pytest.fixture(scope="module")
def two_ranks(mnist_dir, tmp_path_factory):
    """Two ranks at batch 16 each (global batch 32)."""
    path = tmp_path_factory.mktemp("ddp") / "two_ranks.pt"
    succeeded(torchrun("train_ddp.py", 2, *mnist_args(mnist_dir), *EQUIVALENCE, "--batch-size", "16", "--save", path))
    return load_weights(path)


def test_saved_weights_load_into_a_plain_babycnn_and_moved_away_from_the_initial_ones(reference):
    model = BabyCNN(in_channels=1, num_classes=10, image_size=28)
    model.load_state_dict(reference)  # strict: no "module." prefix, no missing or extra keys
    torch.manual_seed(0)
    initial = BabyCNN(in_channels=1, num_classes=10, image_size=28).state_dict()
    assert max_difference(reference, initial) > 100 * TOLERANCE  # training really moved the weights


def test_two_ranks_match_one_process_at_twice_the_batch(reference, two_ranks, mnist_dir, tmp_path):
    assert max_difference(two_ranks, reference) < TOLERANCE
    # Negative control: one process at batch 16 (what a rank would do without DDP) is far off.
    path = tmp_path / "half_batch.pt"
    succeeded(python("train_ddp.py", *mnist_args(mnist_dir), *EQUIVALENCE, "--batch-size", "16", "--save", path))
    assert max_difference(load_weights(path), reference) > 100 * TOLERANCE


def test_gradient_accumulation_matches_one_process_at_twice_the_batch(reference, mnist_dir, tmp_path):
    path = tmp_path / "accumulated.pt"
    run = torchrun("train_ddp.py", 1, *mnist_args(mnist_dir), *EQUIVALENCE, "--batch-size", "16", "--grad-accum", "2", "--save", path)
    succeeded(run)
    assert "global batch 32" in run.output
    assert max_difference(load_weights(path), reference) < TOLERANCE


def test_two_nodes_train_together_like_one_node_with_two_processes(two_ranks, mnist_dir, tmp_path):
    port, path = free_port(), tmp_path / "two_nodes.pt"
    nodes = []
    for node_rank in (0, 1):
        env = launcher_env(NNODES=2, NODE_RANK=node_rank, NPROC_PER_NODE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RDZV_ID=f"test-{port}")
        args = ["bash", ROOT / "run_ddp.sh", *mnist_args(mnist_dir), *EQUIVALENCE, "--batch-size", "16", "--save", path]
        nodes.append(Run(args, env=env))
    for node in nodes:
        succeeded(node)
    assert "DDP on 2 rank(s)" in nodes[0].output + nodes[1].output
    assert max_difference(load_weights(path), two_ranks) == 0  # the very same computation


def test_short_run_learns_with_all_reduced_loss_and_metrics(mnist_dir, tmp_path):
    metrics_path = tmp_path / "metrics.json"
    run = torchrun(
        "train_ddp.py", 2, "--dataset", "auto", "--data-dir", mnist_dir, "--no-download", "--epochs", "10",
        "--batch-size", "32", "--lr", "1e-3", "--scale-lr", "--base-batch-size", "32", "--metrics", metrics_path,
    )
    succeeded(run)
    metrics = json.loads(metrics_path.read_text())
    assert metrics["dataset"] == "mnist"  # auto found the files on disk
    assert metrics["world_size"] == 2 and metrics["global_batch_size"] == 64
    assert metrics["lr"] == pytest.approx(2e-3)  # linear scaling rule: 1e-3 * 64 / 32
    assert metrics["steps"] == 10 * (640 // 2 // 32)
    curve = [loss for _, loss in metrics["loss_curve"]]
    assert curve[-1] < curve[0] / 3, curve
    assert metrics["test_accuracy"] > 0.7  # chance is 0.1
    assert metrics["samples_per_second"] > 0 and metrics["final_train_loss"] == curve[-1]
    # Every rank holds everything: weights + gradients + two AdamW moments = 4 x the parameters.
    assert [r["rank"] for r in metrics["ranks"]] == [0, 1]
    for record in metrics["ranks"]:
        assert record["state_bytes"] == pytest.approx(4 * 4 * metrics["param_count"], rel=0.01)
        assert record["peak_memory_bytes"] > 0
    # Only rank 0 talks, once per epoch, and the loss says it is all-reduced.
    assert run.output.count("epoch 1:") == 1 and run.output.count("epoch 10:") == 1
    assert "loss (all ranks)" in run.output and "[rank1]" not in run.output


def test_auto_falls_back_to_the_synthetic_set_and_learns_it(tmp_path):
    metrics_path = tmp_path / "metrics.json"
    run = torchrun(
        "train_ddp.py", 2, "--data-dir", tmp_path / "empty", "--no-download", "--max-steps", "40", "--metrics", metrics_path
    )
    succeeded(run)
    assert run.output.count("using the built-in synthetic digits instead") == 1
    metrics = json.loads(metrics_path.read_text())
    assert metrics["dataset"] == "synthetic"
    assert metrics["test_accuracy"] > 0.5


def test_bf16_autocast_trains(mnist_dir, tmp_path):
    metrics_path = tmp_path / "metrics.json"
    run = python("train_ddp.py", *mnist_args(mnist_dir), "--precision", "bf16", "--max-steps", "30", "--log-every", "10", "--metrics", metrics_path)
    succeeded(run)
    metrics = json.loads(metrics_path.read_text())
    assert metrics["precision"] == "bf16"
    curve = [loss for _, loss in metrics["loss_curve"]]
    assert all(loss == loss for loss in curve) and curve[-1] < curve[0], curve


BAD_INPUT = {  # case: (flags, the error line it must give)
    "missing-mnist": (["--dataset", "mnist", "--no-download", "--data-dir", "{tmp}/missing"], "put the files in {tmp}/missing/MNIST/raw/"),
    "zero-batch": (["--dataset", "synthetic", "--batch-size", "0"], "argument --batch-size: must be a positive integer, got 0"),
    "batch-over-shard": (["--dataset", "mnist", "--no-download", "--data-dir", "{mnist}", "--batch-size", "321"], "is more than the 320 samples each of the 2 ranks gets"),
    "unknown-dataset": (["--dataset", "imagenet"], "argument --dataset: invalid choice: 'imagenet'"),
    "unwritable-save": (["--dataset", "synthetic", "--save", "{tmp}"], "--save {tmp}: cannot write there"),
}


@pytest.fixture(scope="module")
def bad_input_runs(mnist_dir, tmp_path_factory):
    """Every bad-input case, launched at once (each fails within seconds)."""
    fill = {"tmp": str(tmp_path_factory.mktemp("bad")), "mnist": str(mnist_dir)}
    runs = {case: torchrun("train_ddp.py", 2, *[a.format(**fill) for a in args]) for case, (args, _) in BAD_INPUT.items()}
    return runs, fill


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_one_line_from_rank_zero(case, bad_input_runs):
    runs, fill = bad_input_runs
    assert_one_line_error(runs[case].wait(timeout=90), BAD_INPUT[case][1].format(**fill))


def test_a_rank_that_dies_ends_the_whole_job_quickly():
    run = torchrun("train_ddp.py", 2, "--dataset", "synthetic", "--epochs", "5")
    run.wait_for_text("DDP on 2 rank(s)")
    time.sleep(1)  # into the training loop, where rank 0 waits on rank 1 in every all-reduce
    workers = worker_pids(run.process.pid)
    assert sorted(workers) == [0, 1], workers
    os.kill(workers[1], signal.SIGKILL)
    killed = time.monotonic()
    run.wait(timeout=TIMEOUT_AFTER_KILL + (killed - run.started))
    assert run.returncode != 0
    assert time.monotonic() - killed < TIMEOUT_AFTER_KILL
    assert "epoch 5:" not in run.output


TIMEOUT_AFTER_KILL = 60
