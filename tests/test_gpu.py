"""The GPU suite: the three scripts on NCCL, where torch sees a CUDA GPU. Elsewhere every test here
is reported as skipped, with the reason; the rest of the suite runs on CPUs everywhere.

Runs on min(2, GPUs) ranks, so a 1-GPU workstation runs it too.
"""

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import (
    EQUIVALENCE,
    ROOT,
    Run,
    assert_one_line_error,
    assert_same_math,
    child_env,
    load_weights,
    mnist_args,
    our_lines,
    python,
    run_sh,
    succeeded,
    torchrun,
    with_this_pythons_torchrun,
)

GPUS = torch.cuda.device_count()
RANKS = min(2, GPUS)
pytestmark = pytest.mark.skipif(
    GPUS == 0, reason="no CUDA GPU visible to torch: the GPU tests need one"
)


def gpu_env(**extra):
    """child_env, with the GPUs visible again (the CPU suite hides them)."""
    env = child_env(**extra)
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    else:
        env.pop("CUDA_VISIBLE_DEVICES")
    return env


@pytest.mark.parametrize(
    "script", ["train_ddp.py", "train_fsdp.py", "train_pippy.py", "train_tp.py"]
)
def test_each_script_learns_on_gpus_with_nccl(script, mnist_dir, tmp_path):
    metrics_path = tmp_path / "metrics.json"
    # TP splits each layer over the GPUs there are: --tp 1 on one GPU (nothing split, FSDP over 1)
    layout = ["--tp", str(RANKS)] if script == "train_tp.py" else []
    run = succeeded(
        torchrun(
            script,
            RANKS,
            *layout,
            *mnist_args(mnist_dir),
            "--device",
            "cuda",
            "--epochs",
            "4",
            "--batch-size",
            "32",
            "--metrics",
            metrics_path,
            env=gpu_env(),
        )
    )
    assert "(nccl, cuda)" in run.output
    metrics = json.loads(metrics_path.read_text())
    assert metrics["test_accuracy"] > 0.7  # chance is 0.1
    assert all(
        r["peak_memory_bytes"] > 0 for r in metrics["ranks"]
    )  # CUDA's max allocated, per rank


@pytest.mark.parametrize(
    "script, flags",
    [
        ("train_ddp.py", ["--precision", "bf16"]),
        ("train_fsdp.py", ["--precision", "bf16", "--cpu-offload"]),
    ],
    ids=["ddp-bf16", "fsdp-bf16-cpu-offload"],
)
def test_bf16_and_cpu_offload_learn(script, flags, mnist_dir, tmp_path):
    metrics_path = tmp_path / "metrics.json"
    succeeded(
        torchrun(
            script,
            RANKS,
            *mnist_args(mnist_dir),
            "--device",
            "cuda",
            "--epochs",
            "4",
            "--batch-size",
            "32",
            *flags,
            "--metrics",
            metrics_path,
            env=gpu_env(),
        )
    )
    metrics = json.loads(metrics_path.read_text())
    curve = [loss for _, loss, _ in metrics["loss_curve"]]
    assert curve[-1] < curve[0] / 2 and metrics["test_accuracy"] > 0.5, (
        curve,
        metrics["test_accuracy"],
    )


def test_a_gpu_run_does_the_same_math_as_the_cpu_reference(reference, control, mnist_dir, tmp_path):
    # float64, as the CPU equivalence tests: cuDNN's kernels sum in other orders than the CPU's.
    path = tmp_path / "gpu.pt"
    succeeded(
        python(
            "train_ddp.py",
            *mnist_args(mnist_dir),
            *EQUIVALENCE,
            "--batch-size",
            "32",
            "--device",
            "cuda",
            "--save",
            path,
            env=gpu_env(),
        )
    )
    assert_same_math(load_weights(path), reference, control)


# train_ddp.py --compile on one GPU: CUDA graphs (mode="reduce-overhead"), and with --grad-accum 2
# the gradient buffers the graphs cannot reuse; on RANKS GPUs, inside DDP, torch's default mode
# (CUDA graphs only on one GPU until measured on more). train_fsdp.py compiles each block, without
# CUDA graphs.
@pytest.mark.parametrize(
    "script, processes, accumulate",
    [
        ("train_ddp.py", 1, 1),
        ("train_ddp.py", 1, 2),
        ("train_ddp.py", RANKS, 1),
        ("train_fsdp.py", RANKS, 1),
    ],
    ids=["ddp-1", "ddp-1-accumulate", "ddp", "fsdp"],
)
def test_compiled_runs_do_the_same_math_as_eager_ones(
    script, processes, accumulate, reference, control, mnist_dir, tmp_path
):
    path = tmp_path / "compiled.pt"
    succeeded(
        torchrun(
            script,
            processes,
            *mnist_args(mnist_dir),
            *EQUIVALENCE,
            "--batch-size",
            str(32 // processes // accumulate),
            "--grad-accum",
            str(accumulate),
            "--device",
            "cuda",
            "--compile",
            "--save",
            path,
            env=gpu_env(),
        )
    )
    assert_same_math(load_weights(path), reference, control)


def test_a_checkpoint_resumes_on_gpus_with_every_random_state(mnist_dir, tmp_path):
    common = [
        *mnist_args(mnist_dir),
        *EQUIVALENCE,
        "--batch-size",
        str(32 // RANKS),
        "--device",
        "cuda",
        "--checkpoint-every",
        "12",
    ]
    succeeded(
        torchrun(
            "train_ddp.py",
            RANKS,
            *common,
            "--checkpoint-dir",
            tmp_path / "ck",
            "--save",
            tmp_path / "a.pt",
            env=gpu_env(),
        )
    )
    info = json.loads((tmp_path / "ck" / "step-12" / "checkpoint.json").read_text())
    saved = (
        dcp.FileSystemReader(str(tmp_path / "ck" / "step-12")).read_metadata().state_dict_metadata
    )
    assert info["layout"]["device"] == "cuda" and {"rng.rank0.cpu", "rng.rank0.cuda"} <= set(saved)
    shutil.rmtree(tmp_path / "ck" / "step-24")  # as if the job had stopped after step 12
    run = succeeded(
        torchrun(
            "train_ddp.py",
            RANKS,
            *common,
            "--checkpoint-dir",
            tmp_path / "ck",
            "--save",
            tmp_path / "b.pt",
            env=gpu_env(),
        )
    )
    assert "resumed from" in run.output
    # cuDNN's backward may add in another order from run to run, so the same float64 tolerance
    # applies.
    resumed, uninterrupted = load_weights(tmp_path / "b.pt"), load_weights(tmp_path / "a.pt")
    assert max((resumed[k] - uninterrupted[k]).abs().max().item() for k in resumed) < 1e-12


def test_more_processes_than_gpus_is_one_line_per_node(mnist_dir):
    # Through run_ddp.sh, as a user launches it: when torchrun stops rank 0 before it speaks (rank 1
    # failed first), the launcher prints rank 1's line.
    run = run_sh(
        "train_ddp.py", GPUS + 1, *mnist_args(mnist_dir), "--device", "cuda", env=gpu_env()
    ).wait()
    assert_one_line_error(
        run, f"{GPUS + 1} processes on this node need {GPUS + 1} GPUs, but torch sees {GPUS}"
    )


@pytest.mark.parametrize("model", ["cnn", "gpt"])
def test_deterministic_reruns_are_bitwise_equal(model, mnist_dir, tmp_path):
    """--deterministic (issue 53): two runs of one command end with bitwise the same weights on a
    GPU, where without it they part (cuBLAS's, cuDNN's and atomic adds' orders vary by run). The
    GPT's embedding and attention backward included; no op warns that it has no deterministic
    kernel."""
    data = mnist_args(mnist_dir) if model == "cnn" else []
    flags = ["--model", model, *data, "--device", "cuda", "--deterministic", "--max-steps", "100"]
    flags += ["--no-eval"]
    runs = [
        python(
            "train_ddp.py", *flags, "--save", tmp_path / f"{n}.pt", env=gpu_env(), fork=False
        )  # a new process: CUBLAS_WORKSPACE_CONFIG is read when CUDA starts
        for n in (1, 2)
    ]
    for run in runs:
        assert "does not have a deterministic implementation" not in succeeded(run).output
    first, second = (load_weights(tmp_path / f"{n}.pt") for n in (1, 2))
    assert all(torch.equal(first[name], second[name]) for name in first)


# ---- 2+ GPUs: what NCCL does and gloo cannot show (issue 60) ----
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs: NCCL between two ranks")

NCCL_ALONE = """import os, time
import torch, torch.distributed as dist
from plumbing import failures

def main():
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    if dist.get_rank() == 1:
        raise OSError(5, "Input/output error")  # rank 1's own error: exit code 75
    dist.all_reduce(torch.ones(1000, device=device))  # rank 1 never joins it
    torch.cuda.synchronize()

failures.run(main)
"""


@two_gpus
def test_one_ranks_own_error_ends_an_nccl_job_within_seconds(tmp_path):
    """Rank 0 waits in an all-reduce rank 1 never joins: rank 1 exits at once with its line (no
    destroy_process_group, whose flush would wait for rank 0), and torchrun's signal ends rank 0
    long before NCCL's watchdog (10 minutes)."""
    (tmp_path / "worker.py").write_text(NCCL_ALONE)
    env = with_this_pythons_torchrun(gpu_env(NPROC_PER_NODE=2))
    run = Run(["bash", ROOT / "launch.sh", tmp_path / "worker.py"], env=env).wait(timeout=300)
    assert run.returncode == 75 and run.seconds < 90, run.output
    assert our_lines(run.output)[-1].startswith("error: OSError: [Errno 5] Input/output error")
    assert "SIGABRT" not in run.output and "Traceback" not in run.output, run.output


def test_a_compiled_accumulating_run_resumes_with_its_optimizer_states(mnist_dir, tmp_path):
    """--compile --grad-accum 2 on one GPU: CUDA graphs, whose gradients are kept from the start.
    DCP's get_state_dict then made no optimizer states to load into, and the resume started SGD's
    momentum from zero without a word (issue 60). Resumed at step 12, it ends as the run never
    stopped."""
    common = [*mnist_args(mnist_dir), *EQUIVALENCE, "--batch-size", "16", "--grad-accum", "2"]
    common += ["--device", "cuda", "--compile", "--checkpoint-every", "12"]
    whole = [*common, "--checkpoint-dir", tmp_path / "ck", "--save", tmp_path / "a.pt"]
    succeeded(python("train_ddp.py", *whole, env=gpu_env()))
    shutil.rmtree(tmp_path / "ck" / "step-24")  # as if the job had stopped after step 12
    resumed = [*common, "--checkpoint-dir", tmp_path / "ck", "--save", tmp_path / "b.pt"]
    assert "resumed from" in succeeded(python("train_ddp.py", *resumed, env=gpu_env())).output
    a, b = load_weights(tmp_path / "a.pt"), load_weights(tmp_path / "b.pt")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-12


NCCL_TIMEOUT = """import datetime, os, time
import torch, torch.distributed as dist

device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(device)
dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=10))
tensor = torch.ones(1000, device=device)
dist.all_reduce(tensor)  # number 1: both ranks
torch.cuda.synchronize()
if dist.get_rank() == 1:
    time.sleep(300)  # hung: it never calls number 2
dist.all_reduce(tensor)
torch.cuda.synchronize()
"""


@two_gpus
def test_an_nccl_timeout_is_said_as_one_and_retried_with_its_flight_recorder(tmp_path):
    """launch.sh's TORCH_NCCL_ASYNC_ERROR_HANDLING=3: rank 0's watchdog writes its flight recorder
    to FLIGHT_RECORDER_DIR, then ends the process; the launch names the collective that timed out,
    exit code 75 (it said "rank 0 was killed by SIGABRT", 134, with mode 1 and no dump)."""
    (tmp_path / "worker.py").write_text(NCCL_TIMEOUT)
    env = with_this_pythons_torchrun(gpu_env(NPROC_PER_NODE=2, FLIGHT_RECORDER_DIR=tmp_path / "fr"))
    run = Run(["bash", ROOT / "launch.sh", tmp_path / "worker.py"], env=env).wait(timeout=300)
    assert f"(flight recorder dumps on an NCCL timeout: {tmp_path / 'fr'})" in run.output
    assert run.returncode == 75 and (tmp_path / "fr" / "rank_0").exists(), run.output
    last = our_lines(run.output)[-1]
    assert last.startswith("error: a collective timed out on rank 0 (pid "), run.output
    assert "(nccl:all_reduce number " in last, last  # the one the dump shows waiting


@two_gpus
def test_tp_keeps_each_ranks_dropout_seed(tmp_path):
    """--model gpt-gpu (dropout 0.2) under TP on 2 GPUs: DTensor's random-number tracker, made on
    its first random op, replaced every rank's CUDA seed with rank 0's and warned on each rank;
    train_tp.py makes it first, without that sync (as torchtitan's set_determinism)."""
    flags = ["--model", "gpt-gpu", "--tp", "2", "--device", "cuda", "--max-steps", "5"]
    run = succeeded(torchrun("train_tp.py", 2, *flags, "--no-eval", env=gpu_env()))
    assert "synchronizing RNG states" not in run.output, run.output
