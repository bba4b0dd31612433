"""launch.sh (behind every run_*.sh): how many processes it starts, and what it refuses."""

import os

from conftest import ROOT, Run, assert_one_line_error, launcher_env, mnist_args, succeeded


def test_the_process_count_is_the_gpus_torch_sees_not_those_nvidia_smi_lists(mnist_dir, tmp_path):
    # nvidia-smi lists every GPU of the machine, also those CUDA_VISIBLE_DEVICES hides (here: all of them).
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(
        '#!/bin/sh\nfor i in 0 1 2 3 4 5 6 7; do echo "GPU $i: NVIDIA H100 (UUID: GPU-$i)"; done\n')
    (fake / "nvidia-smi").chmod(0o755)
    env = launcher_env()
    env.pop("NPROC_PER_NODE", None)
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    run = succeeded(Run(["bash", ROOT / "run_ddp.sh", *mnist_args(mnist_dir), "--max-steps", "1", "--no-eval"],
                        env=env))
    assert "DDP on 2 rank(s)" in run.output  # no GPU for torch: 2 CPU processes, not 8


def test_several_nodes_without_master_addr_is_one_line():
    env = launcher_env(NNODES=2, NODE_RANK=1)
    env.pop("MASTER_ADDR", None)
    run = Run(["bash", ROOT / "run_ddp.sh"], env=env).wait(timeout=30)
    assert run.returncode == 2
    assert_one_line_error(run, "NNODES=2 needs MASTER_ADDR, node 0's address")
