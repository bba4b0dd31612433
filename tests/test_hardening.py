"""Defects of the old plumbing, each with a test that failed on it: downloads under a collective's
timeout, a fresh optimizer stepped once before training, the checkpoint's lr kept on resume, a stuck
rank deaf to a second signal, autocast around backward. (The pipeline replicas all-reducing once per
micro-step: test_pippy.py's layout with replicas.)"""

import os
import shutil
import signal
import time

import torch
import torch.distributed.checkpoint as dcp
from conftest import (
    ROOT,
    alive,
    child_env,
    load_weights,
    max_difference,
    mnist_args,
    python,
    succeeded,
    torchrun,
    worker_pids,
)

from plumbing import failures

STAND_INS = ROOT / "tests" / "stand_ins"


def test_a_download_happens_before_the_process_group_and_once_per_directory(tmp_path):
    # The stand-in torchvision refuses to download inside a process group and logs each download.
    env = child_env(PYTHONPATH=f"{STAND_INS}{os.pathsep}{ROOT}")
    run = succeeded(
        torchrun(
            "train_ddp.py",
            2,
            "--dataset",
            "fashion-mnist",
            "--data-dir",
            tmp_path,
            "--max-steps",
            "4",
            "--batch-size",
            "32",
            "--log-every",
            "2",
            env=env,
        )
    )
    assert "fashion-mnist; 4 steps" in run.output and "test accuracy" in run.output
    assert (
        len((tmp_path / "downloads.log").read_text().split()) == 1
    )  # the other rank waited on the lock, then read


def test_a_fresh_adamw_starts_at_step_zero(mnist_dir, tmp_path):
    # get_state_dict() steps an optimizer with no state once (lr 0) to create it: before a fresh
    # run's first step, that made AdamW's bias correction count one step too many.
    succeeded(
        python(
            "train_ddp.py",
            *mnist_args(mnist_dir),
            "--max-steps",
            "10",
            "--checkpoint-every",
            "10",
            "--checkpoint-dir",
            tmp_path / "ck",
            "--no-eval",
        )
    )
    state = {"optimizer": {"blocks.0.conv1.weight": {"step": torch.zeros(())}}}
    dcp.load(state, checkpoint_id=tmp_path / "ck" / "step-10", no_dist=True)
    assert state["optimizer"]["blocks.0.conv1.weight"]["step"].item() == 10


def test_a_resumed_run_uses_the_lr_of_its_own_flags_and_says_so(mnist_dir, tmp_path):
    common = [
        *mnist_args(mnist_dir),
        "--optimizer",
        "sgd",
        "--momentum",
        "0",
        "--weight-decay",
        "0",
        "--batch-size",
        "32",
        "--log-every",
        "5",
        "--checkpoint-every",
        "10",
        "--no-eval",
        "--lr-schedule",
        "constant",
        "--warmup-steps",
        "0",
    ]
    succeeded(
        python(
            "train_ddp.py",
            *common,
            "--max-steps",
            "10",
            "--lr",
            "0.01",
            "--checkpoint-dir",
            tmp_path / "ck",
        )
    )
    finals = {}
    for lr in ("0.01", "0.02"):  # both resume from the same checkpoint, saved at lr 0.01
        (tmp_path / lr).mkdir()
        shutil.copytree(tmp_path / "ck", tmp_path / lr / "ck")
        run = succeeded(
            python(
                "train_ddp.py",
                *common,
                "--max-steps",
                "20",
                "--lr",
                lr,
                "--checkpoint-dir",
                tmp_path / lr / "ck",
                "--save",
                tmp_path / lr / "final.pt",
            )
        )
        finals[lr] = load_weights(tmp_path / lr / "final.pt")
        changed = "the peak lr is now 0.02, not the checkpoint's 0.01" in run.output
        assert changed == (lr == "0.02") and "step 20/20: loss (all ranks)" in run.output, (
            run.output
        )
        assert (
            f"lr {float(lr):.3g}, " in run.output.split("resumed from")[1]
        )  # the logged lr is the one used
    assert (
        max_difference(finals["0.01"], finals["0.02"]) > 1e-4
    )  # the old code kept 0.01 for both: the same weights


def test_a_second_signal_ends_a_rank_stuck_in_a_collective(mnist_dir):
    run = torchrun("train_ddp.py", 2, *mnist_args(mnist_dir), "--epochs", "50", "--log-every", "1")
    run.wait_for_text("step 2/")
    workers = worker_pids(run.process.pid)
    os.kill(workers[1], signal.SIGSTOP)  # rank 1 stops: rank 0 waits for it in its next all-reduce
    try:
        os.kill(workers[0], signal.SIGTERM)
        # StopSignals takes a signal over STOP_GRACE after the first as a second one (torchrun's
        # copy of one signal comes at once): sleep() waits at least that long, however loaded the
        # machine.
        time.sleep(failures.STOP_GRACE + 0.5)
        assert alive(
            workers[0]
        )  # the first only asks for a stop at a logging step, which rank 0 cannot reach
        os.kill(workers[0], signal.SIGTERM)
        # Without the second signal's watcher, rank 0 would wait in the all-reduce for the 10-minute
        # timeout.
        run.wait_for_text("SIGTERM again: rank 0 ends now, with no checkpoint", timeout=120)
        deadline = time.monotonic() + 60
        while alive(workers[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(workers[0]), "rank 0 said it ends, and did not"
    finally:
        run.kill()
        run.wait()


def test_bf16_autocast_wraps_each_stage_forward_as_ddp_wraps_the_model(mnist_dir, tmp_path):
    # One stage and one microbatch: the same computation as DDP's, bf16 rounding and all, if
    # autocast wraps the same operations (the forward) in both.
    flags = [
        *mnist_args(mnist_dir),
        "--precision",
        "bf16",
        "--batch-size",
        "32",
        "--max-steps",
        "20",
        "--no-eval",
    ]
    runs = [
        python("train_ddp.py", *flags, "--save", tmp_path / "ddp.pt"),
        python("train_pippy.py", *flags, "--microbatches", "1", "--save", tmp_path / "pipeline.pt"),
    ]
    for run in runs:
        succeeded(run)
    # (That 2 stages learn in bf16: test_course.py's test_the_pipeline_trains_in_bf16.)
    assert (
        max_difference(load_weights(tmp_path / "ddp.pt"), load_weights(tmp_path / "pipeline.pt"))
        == 0
    )
