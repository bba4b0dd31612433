"""The multi-GPU node by the book (issue 60): one rank's error ends the job at once, the default
commands fit the node, NCCL's failures named for what they are. Each decision is a function called
here; gloo runs show what gloo can; tests/test_gpu.py holds the NCCL runs for 2+ GPUs."""

import argparse
import json
import math
import re
import signal
import socket

import pytest
from conftest import (
    ROOT,
    Run,
    assert_one_line_error,
    free_port,
    launcher_env,
    mnist_args,
    our_lines,
    run_sh,
    succeeded,
    torchrun,
)

import train_pippy
import train_tp
from plumbing import failures

ALONE = """import os, time
import torch, torch.distributed as dist
from plumbing import failures

def main():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        # as DDP's bucket during backward: a collective rank 0 has not joined yet
        dist.all_reduce(torch.ones(1000), async_op=True)
        raise OSError(5, "Input/output error")  # rank 1's own error: exit code 75
    time.sleep(120)  # a slow step: rank 0 would join that all-reduce only later

failures.run(main)
"""


def test_one_ranks_own_error_ends_the_job_within_seconds_with_its_line(tmp_path):
    """Rank 1 raises alone with a collective in flight: the old end destroyed the process group,
    which waits for that collective (gloo joins its threads; NCCL flushes the communicator), so
    the job hung until rank 0 woke (2 minutes here, the watchdog's 10 on NCCL). Now rank 1 exits
    at once with its line and exit code, and torchrun's signal ends rank 0."""
    (tmp_path / "worker.py").write_text(ALONE)
    run = Run(
        ["bash", ROOT / "launch.sh", tmp_path / "worker.py"], env=launcher_env(NPROC_PER_NODE=2)
    ).wait(timeout=100)
    lines = our_lines(run.output)
    assert run.returncode == failures.RETRY_EXIT, run.output
    assert lines[-1].startswith("error: OSError: [Errno 5] Input/output error; it may pass on a")
    assert run.seconds < 60, f"{run.seconds:.0f} s:\n{run.output}"  # torch's import included
    assert "Traceback" not in run.output and socket.gethostname() not in lines[-1], run.output


@pytest.mark.parametrize(
    "problem, world_size, destroys",
    [
        (None, 2, True),  # main returned on every rank
        (failures.Stopped("stopped by SIGTERM", 143), 8, True),  # the ranks agreed to stop
        (failures.UsageError("bad input"), 2, False),  # one rank may have found it alone
        (OSError(5, "Input/output error"), 2, False),
        (RuntimeError("a crash"), 2, False),
        (KeyboardInterrupt(), 2, False),
        (RuntimeError("a crash"), 1, True),  # no peer to wait for
    ],
)
def test_the_process_group_is_destroyed_only_where_the_ranks_end_together(
    problem, world_size, destroys
):
    assert failures.ends_together(problem, world_size) is destroys


# ---- NCCL's failures named for what they are ----
WATCHDOG = """import datetime, os, time
import torch, torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=2))
tensor = torch.ones(1000)
dist.all_reduce(tensor)  # number 1: both ranks
if dist.get_rank() == 1:
    time.sleep(60)  # hung: it never calls number 2
try:
    dist.all_reduce(tensor)
except RuntimeError:  # as NCCL's watchdog at the timeout: the dump (WRITE_DUMP), then SIGABRT
    if WRITE_DUMP:
        with open(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + "0", "wb") as file:
            file.write(_dump_fr_trace())
    os.abort()
"""


@pytest.mark.slow  # 18 s on a loaded machine: the README's suite keeps its 8 minutes
def test_a_watchdog_timeout_is_a_collectives_timeout_retried_not_a_kill(tmp_path):
    """NCCL's watchdog ends a rank whose collective timed out with SIGABRT, after writing its flight
    recorder (TORCH_NCCL_ASYNC_ERROR_HANDLING=3, launch.sh's). Played here on gloo, with torch's own
    dump: the launch said "rank 0 was killed by SIGABRT", exit code 134; now the collective timed
    out, which one and where the dumps are, exit code 75 (retried). Without a dump (the control,
    launched at the same time), a SIGABRT is still a kill."""
    runs = {}
    for dump in (True, False):
        (tmp_path / f"{dump}").mkdir()  # launch.sh makes FLIGHT_RECORDER_DIR on a GPU node
        (tmp_path / f"{dump}" / "worker.py").write_text(WATCHDOG.replace("WRITE_DUMP", str(dump)))
        env = launcher_env(NPROC_PER_NODE=2, FLIGHT_RECORDER_DIR=tmp_path / f"{dump}")
        command = ["bash", ROOT / "launch.sh", tmp_path / f"{dump}" / "worker.py"]
        runs[dump] = Run(command, env=env)
    run, fr = runs[True].wait(timeout=120), tmp_path / "True"
    assert run.returncode == failures.RETRY_EXIT, run.output
    assert re.fullmatch(
        r"error: a collective timed out on rank 0 \(pid \d+\) on \S+ \(gloo:all_reduce number "
        r"2\): a rank stopped calling collectives or hung; each rank's flight recorder is in "
        + re.escape(f"{fr} (python -m torch.distributed.flight_recorder.fr_trace {fr}); ")
        + r"it may pass on a retry \(exit code 75: torchrun restarts it while MAX_RESTARTS "
        r"allows\)",
        our_lines(run.output)[-1],
    ), run.output
    control = runs[False].wait(timeout=120)
    assert control.returncode == 128 + signal.SIGABRT, control.output
    assert our_lines(control.output)[-1].endswith("was killed by SIGABRT"), control.output


# ---- the default commands fit the node: train_pippy.py's pipeline degree ----
def layout(world_size, schedule="1f1b", blocks=4, data_parallel=None):
    args = argparse.Namespace(
        batch_size=64,
        microbatches=8,
        schedule=schedule,
        data_parallel=data_parallel,
        stages_per_rank=None,
        compile=False,
    )
    chosen = train_pippy.check_flags(args, world_size, blocks)
    return world_size // args.data_parallel, args.data_parallel, chosen


@pytest.mark.parametrize(
    "world_size, schedule, blocks, pipeline_ranks",
    [
        (8, "1f1b", 4, 4),  # BabyCNN on 8 GPUs: 4 stages x 2 replicas (it failed: 8 stages)
        (8, "1f1b", 6, 4),  # --model gpt: 6 blocks, and 4 divides 8
        (6, "1f1b", 6, 6),
        (8, "interleaved-1f1b", 4, 2),  # 2 stages a rank
        (3, "interleaved-1f1b", 6, 3),
        (3, "interleaved-1f1b", 4, 1),  # 3 ranks x 2 stages do not fit 4 blocks: 1 x 3 replicas
        (2, "1f1b", 4, 2),  # as before: one pipeline
        (1, "1f1b", 4, 1),
    ],
)
def test_the_pipeline_degree_fits_the_models_blocks(world_size, schedule, blocks, pipeline_ranks):
    pp, dp, chosen = layout(world_size, schedule, blocks)
    assert (pp, dp) == (pipeline_ranks, world_size // pipeline_ranks)
    assert bool(chosen) == (dp > 1), chosen  # the start line says a default that replicates


def test_a_layout_that_does_not_fit_names_the_flag_that_does():
    with pytest.raises(failures.UsageError) as error:
        layout(8, data_parallel=1)
    assert str(error.value) == (
        "8 pipeline ranks x 1 stages per rank = 8 stages, but model.blocks has only 4 blocks: "
        "give --data-parallel 2"
    )


@pytest.mark.slow  # 8 ranks on 2 cores: 45 s
def test_run_pippy_sh_on_8_ranks_trains_4_stages_x_2_replicas(mnist_dir, tmp_path):
    """`bash run_pippy.sh` as on an 8-GPU node (8 gloo ranks here): BabyCNN's 4 blocks give 4
    pipeline ranks and 2 replicas, said on the start line; each rank runs one stage."""
    run = run_sh(
        "train_pippy.py",
        8,
        *mnist_args(mnist_dir),
        "--max-steps",
        "4",
        "--log-every",
        "2",
        "--no-eval",
        "--metrics",
        tmp_path / "m.json",
    ).wait(timeout=400)
    assert run.returncode == 0, run.output[-3000:]
    assert "4 stages: blocks [[0], [1], [2], [3]], 8 microbatches) x 2 replica(s) (" in run.output
    losses = [float(x) for x in re.findall(r"loss \(last stage\) (\S+),", run.output)]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), run.output
    ranks = json.loads((tmp_path / "m.json").read_text())["ranks"]
    assert sorted(r["stages"][0] for r in ranks) == [0, 0, 1, 1, 2, 2, 3, 3], ranks


# ---- the optimizer's states come back on every resume ----
RESUME = """import sys, torch, torch.distributed as dist
from plumbing import checkpoint_dir, failures, training

def main():
    dist.init_process_group("gloo")
    args = training.parser("resume").parse_args(["--checkpoint-dir", sys.argv[1], *sys.argv[3:]])
    plan = training.Plan(args, 640, dist.get_world_size(), "synthetic")
    torch.manual_seed(0)
    model, x = torch.nn.Linear(8, 4), torch.randn(16, 8)
    optimizer = training.make_optimizer(args, model.parameters())
    checkpointer = checkpoint_dir.Checkpoints(args, plan, torch.device("cpu"))
    if sys.argv[2] == "train":  # 2 steps, the second saved
        for step in (1, 2):
            model(x * step).square().mean().backward()
            training.set_lr(optimizer, plan.lr(step))
            optimizer.step()
        checkpointer.save(2, 0, 2, model, optimizer, [])
        torch.save(optimizer.state_dict()["state"], f"{sys.argv[1]}/rank{dist.get_rank()}.pt")
        return
    if sys.argv[2] == "preset":  # as train_ddp.py's --compile --grad-accum 2 with CUDA graphs
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in model.parameters()]
    checkpointer.resume(model, optimizer, print)
    saved = torch.load(f"{sys.argv[1]}/rank{dist.get_rank()}.pt")
    states = optimizer.state_dict()["state"]
    same = [torch.equal(states[i][k], saved[i][k]) for i in saved for k in saved[i]]
    kept = all(p.grad is g for p, g in zip(model.parameters(), grads))
    print(f"rank {dist.get_rank()}: {sum(same)} of {len(same)} states loaded; grads kept: {kept}")

failures.run(main)
"""


@pytest.mark.slow  # 41 s on a loaded machine: the README's suite keeps its 8 minutes
def test_a_resume_loads_the_optimizers_states_also_where_gradients_are_preset(tmp_path):
    """--compile --grad-accum > 1 keeps gradients for CUDA graphs from the start. DCP's
    get_state_dict then skipped making the fresh AdamW's states, so the resume loaded none and
    said nothing (a KeyError here). Now all 6 (exp_avg, exp_avg_sq, step of 2 tensors) come back
    on both ranks, and the preset gradients are the same tensors after it. A resume that
    would load none (SGD without the saved momentum) refuses in one line."""
    (tmp_path / "resume.py").write_text(RESUME)
    for name in ("adamw", "sgd"):
        (tmp_path / name).mkdir()
    runs = {
        name: torchrun(tmp_path / "resume.py", 2, tmp_path / name, "train", "--optimizer", name)
        for name in ("adamw", "sgd")
    }
    for run in runs.values():
        succeeded(run)
    flags = ("--optimizer", "sgd", "--momentum", "0")
    command = ["bash", ROOT / "launch.sh", tmp_path / "resume.py", tmp_path / "sgd", "none"]
    refused = Run([*command, *flags], env=launcher_env(NPROC_PER_NODE=2))
    run = succeeded(torchrun(tmp_path / "resume.py", 2, tmp_path / "adamw", "preset"))
    for rank in (0, 1):
        assert f"rank {rank}: 6 of 6 states loaded; grads kept: True" in run.output, run.output
    assert_one_line_error(refused.wait(), "holds optimizer states, but this run's optimizer has")


# ---- several nodes by the book ----
# train_ddp.py as it is, but for the 60 s a rank waits for rank 0's file (NFS may cache a folder's
# listing): 2 s, where the refusal, its line and its exit code are what the test reads.
HASTY = f"""import runpy, sys
from plumbing import checkpoint_dir

assert checkpoint_dir.Checkpoints._check_shared.__defaults__ == (60,)
checkpoint_dir.Checkpoints._check_shared.__defaults__ = (2,)
sys.argv[0] = {str(ROOT / "train_ddp.py")!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow  # two nodes
def test_a_checkpoint_dir_the_nodes_do_not_share_is_refused_before_training(tmp_path):
    """Two "nodes" on this machine, each in a folder of its own, given `--checkpoint-dir ck`: two
    folders, as a node's local disk is. Each node saved its own ranks' parts and the resume failed;
    now the first collective of the resume finds it, before the first step, in one line."""
    (tmp_path / "hasty.py").write_text(HASTY)
    port, runs = free_port(), []
    for node_rank in (0, 1):
        (tmp_path / f"node{node_rank}").mkdir()
        env = launcher_env(NNODES=2, NODE_RANK=node_rank, NPROC_PER_NODE=1, MAX_RESTARTS=0)
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RDZV_ID": f"t-{port}"}
        command = ["bash", ROOT / "launch.sh", tmp_path / "hasty.py", "--dataset", "synthetic"]
        runs.append(
            Run([*command, "--checkpoint-dir", "ck"], env=env, cwd=tmp_path / f"node{node_rank}")
        )
    output = "".join(run.wait(timeout=300).output for run in runs)
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and all(run.returncode == 2 for run in runs), output
    assert re.fullmatch(
        r"error: --checkpoint-dir ck is not shared: rank\(s\) 1 \(\S+\) do not see rank 0's files "
        r"there, yet every rank writes .* give a folder every node mounts",
        errors[0],
    ), output
    assert "step 1" not in output and not list(tmp_path.glob("node*/ck/step-*")), output


@pytest.mark.parametrize("tp, warned", [(16, True), (3, True), (8, False), (4, False)])
def test_a_tp_group_across_nodes_is_a_warning(tp, warned, monkeypatch, capsys):
    """train_tp.py on nodes of 8 ranks (torchrun's LOCAL_WORLD_SIZE): a --tp that does not divide
    8 puts a tp group on two nodes, whose collectives (several a layer) cross the network."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    args = argparse.Namespace(model="gpt", tp=tp, width=1, compile=False)
    train_tp.check_flags(args, world_size=48)
    line = f"warning: --tp {tp} spans nodes of 8 ranks: give one that divides 8\n"
    assert capsys.readouterr().out == (line if warned else "")
