"""python -m plumbing.consolidate: each script's checkpoint, at any world size, as --save's file."""

import json
import subprocess
import sys
import time

import pytest
import torch
from conftest import (
    ROOT,
    TIMEOUT,
    Run,
    assert_one_line_error,
    child_env,
    forks,
    load_weights,
    mnist_args,
    python,
    succeeded,
    torchrun,
)

from models import BabyCNN, data

# 8 steps, a checkpoint at 4 and 8. A constant lr without warmup: the first 4 steps of this run are
# a run of --max-steps 4, so its step-4 is what a run stopped there leaves, and that run's --save is
# what step-4 must hold.
SMALL = [
    "--max-steps",
    "8",
    "--checkpoint-every",
    "4",
    "--log-every",
    "4",
    "--no-eval",
    "--lr-schedule",
    "constant",
    "--warmup-steps",
    "0",
]
LAYOUTS = {  # name: (script, ranks, flags); every script at two world sizes
    "ddp-1": ("train_ddp.py", 1, ["--batch-size", "32"]),
    "ddp-2": ("train_ddp.py", 2, ["--batch-size", "16"]),
    "fsdp-2": ("train_fsdp.py", 2, ["--batch-size", "16"]),
    "fsdp-4": ("train_fsdp.py", 4, ["--batch-size", "8"]),
    "pippy-2": ("train_pippy.py", 2, ["--batch-size", "32"]),  # 2 stages
    "pippy-4": ("train_pippy.py", 4, ["--batch-size", "16", "--data-parallel", "2"]),  # 2 x 2
    "tp-2": ("train_tp.py", 2, ["--batch-size", "32", "--tp", "2"]),
    "tp-4": ("train_tp.py", 4, ["--batch-size", "16", "--tp", "2"]),  # (dp 2, tp 2)
}


def train(layout, directory, mnist_dir, *more):
    """Start a run of ``layout`` with SMALL (and ``more``): directory/ck, directory/final.pt."""
    script, ranks, flags = LAYOUTS[layout]
    args = [
        *mnist_args(mnist_dir),
        *SMALL,
        *flags,
        *more,
        "--checkpoint-dir",
        directory / "ck",
        "--save",
        directory / "final.pt",
    ]
    return python(script, *args) if ranks == 1 else torchrun(script, ranks, *args)


def consolidate(checkpoint, out):
    """``python -m plumbing.consolidate checkpoint out``, waited for."""
    command = [sys.executable, "-m", "plumbing.consolidate", checkpoint, out]
    return Run(command, fork=forks(None)).wait()


def assert_same_model(out, save, ordered=True):
    """The consolidated file is --save's: the same names (``ordered``: in the same order), bitwise
    the same tensors (dtypes too), and bitwise the same logits of BabyCNN on the test set."""
    weights, saved = load_weights(out), load_weights(save)
    assert (list(weights) == list(saved)) if ordered else (weights.keys() == saved.keys())
    for name, tensor in saved.items():
        assert weights[name].dtype == tensor.dtype and torch.equal(weights[name], tensor), name
    images = data.find("auto", None, download=False)["splits"][1][0][:300].float() / 255
    logits = []
    for state in (weights, saved):
        model = BabyCNN().eval()
        model.load_state_dict(state)  # strict: every name and shape of the plain model
        with torch.no_grad():
            logits.append(model(images))
    assert torch.equal(*logits)


@pytest.fixture(scope="module")
def ddp_runs(mnist_dir, tmp_path_factory):
    """DDP on 2 ranks, started together: the 8-step run (8/ck, 8/final.pt) and its first 4 steps
    alone (4/final.pt)."""
    directory = tmp_path_factory.mktemp("consolidate-ddp")
    runs = [
        train("ddp-2", directory / "8", mnist_dir),
        train("ddp-2", directory / "4", mnist_dir, "--max-steps", "4"),
    ]
    for run in runs:
        succeeded(run)
    return directory


def test_a_ddp_checkpoint_is_the_runs_save_and_a_stopped_runs_converts_too(ddp_runs, tmp_path):
    checkpoints = ddp_runs / "8" / "ck"
    run = consolidate(checkpoints, tmp_path / "newest.pt")  # a --checkpoint-dir: its newest, step-8
    said = f"the model of {checkpoints}/step-8 (step 8, saved by 2 rank(s))"
    assert run.returncode == 0 and said in run.output, run.output
    assert_same_model(tmp_path / "newest.pt", ddp_runs / "8" / "final.pt")
    # step-4, all that a run stopped at step 4 leaves (no --save): what a run of 4 steps saves
    assert consolidate(checkpoints / "step-4", tmp_path / "step-4.pt").returncode == 0
    assert_same_model(tmp_path / "step-4.pt", ddp_runs / "4" / "final.pt")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "ddp-2"])
def test_every_scripts_checkpoint_is_its_save(layout, mnist_dir, tmp_path):
    succeeded(train(layout, tmp_path, mnist_dir))
    run = consolidate(tmp_path / "ck", tmp_path / "out.pt")
    assert run.returncode == 0 and "/ck/step-8 (step 8" in run.output, run.output
    # A pipeline's names come stage by stage, the last first (plumbing/consolidate.py says why)
    ordered = not layout.startswith("pippy")
    assert_same_model(tmp_path / "out.pt", tmp_path / "final.pt", ordered)


def test_a_damaged_checkpoint_or_none_is_one_line_and_nothing_is_written(ddp_runs, tmp_path):
    step = tmp_path / "step-8"
    step.mkdir()
    for file in (ddp_runs / "8" / "ck" / "step-8").iterdir():  # a copy: 4 files, under 1 MB
        (step / file.name).write_bytes(file.read_bytes())
    control = consolidate(step, tmp_path / "control.pt")  # the copy, before it is damaged, converts
    assert control.returncode == 0, control.output
    shard = step / "__1_0.distcp"
    damaged = bytearray(shard.read_bytes())
    damaged[1000:1016] = bytes(b ^ 0xFF for b in damaged[1000:1016])  # 16 bytes flipped, same size
    shard.write_bytes(damaged)
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (
            step,
            (
                f"checkpoint {step} is damaged (__1_0.distcp does not match its checksum in "
                "checkpoint.json): nothing was written"
            ),
        ),
        (empty, f"{empty} is not a checkpoint: it has no checkpoint.json and no step-<N>"),
        (tmp_path / "missing", f"{tmp_path / 'missing'} is not a directory"),
    ]
    for checkpoint, message in cases:
        assert_one_line_error(consolidate(checkpoint, tmp_path / "out.pt"), message)
        assert not (tmp_path / "out.pt").exists()
    assert_same_model(tmp_path / "control.pt", ddp_runs / "8" / "final.pt")


# Resident memory before the conversion and at its peak (the kernel's high-water mark: getrusage's
# ru_maxrss would keep the peak of the forked pytest process across the exec). A first conversion,
# of a width-1 checkpoint, pays for what any costs once: DCP's lazy imports and the like.
PROBE = """import sys
from plumbing.consolidate import consolidate
def kib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field))
consolidate(sys.argv[1], sys.argv[3])
before = kib("VmRSS:")
consolidate(sys.argv[2], sys.argv[3])
print(before * 1024, kib("VmHWM:") * 1024)
"""


@pytest.mark.slow
def test_consolidating_holds_about_one_model_in_memory(ddp_runs, mnist_dir, tmp_path):
    """The peak resident memory above what the process held before: the model (--width 8: 1.8 M
    parameters, 7.4 MB) and DCP's copy of one tensor at a time, not AdamW's two moments beside it in
    the checkpoint, nor a second copy of the model."""
    succeeded(
        python(
            "train_ddp.py",
            *mnist_args(mnist_dir),
            "--width",
            "8",
            "--max-steps",
            "1",
            "--no-eval",
            "--batch-size",
            "16",
            "--checkpoint-dir",
            tmp_path / "ck",
        )
    )
    started = time.monotonic()
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, ddp_runs / "8" / "ck", tmp_path / "ck", tmp_path / "out.pt"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert probe.returncode == 0, probe.stderr
    before, peak = map(int, probe.stdout.split()[-2:])
    model = sum(t.nbytes for t in load_weights(tmp_path / "out.pt").values())
    files = json.loads((tmp_path / "ck" / "step-1" / "checkpoint.json").read_text())["files"]
    print(
        f"model {model / 1e6:.1f} MB, checkpoint {sum(s for s, _ in files.values()) / 1e6:.1f} "
        f"MB: peak resident memory {peak / 1e6:.0f} MB, {(peak - before) / 1e6:.1f} MB above the "
        f"{before / 1e6:.0f} MB before, in {time.monotonic() - started:.1f} s"
    )
    assert peak - before < 1.5 * model, (before, peak, model)
