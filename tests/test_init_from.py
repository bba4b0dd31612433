"""--init-from: a run starts from the weights in one file, under every strategy, with a fresh
optimizer and lr schedule. Each rank reads what it holds: under FSDP and TP only its own parts."""

import pytest
import torch
from conftest import (
    CONTROL_FLOOR,
    EQUIVALENCE,
    ROOT,
    TOLERANCE,
    assert_one_line_error,
    launch,
    load_weights,
    mnist_args,
    python,
    relative_difference,
    succeeded,
    torchrun,
)
from safetensors.torch import save_file

LAYOUTS = {  # global batch 32 each, as the one process of the reference
    "ddp-1": ("train_ddp.py", 1, ["--batch-size", "32"]),
    "fsdp-2": ("train_fsdp.py", 2, ["--batch-size", "16"]),
    "pipeline-2": ("train_pippy.py", 2, ["--batch-size", "32", "--microbatches", "2"]),
    "tp-2": ("train_tp.py", 2, ["--batch-size", "32", "--tp", "2"]),
}


@pytest.fixture(scope="module")
def trained(mnist_dir, tmp_path_factory):
    """A file of another run's final weights (fp32, 10 steps), and the run from it on one process:
    the reference."""
    directory = tmp_path_factory.mktemp("init")
    succeeded(
        python(
            "train_ddp.py",
            *mnist_args(mnist_dir),
            "--max-steps",
            "10",
            "--no-eval",
            "--save",
            directory / "trained.pt",
        )
    )
    save_file(load_weights(directory / "trained.pt"), directory / "trained.safetensors")
    run = succeeded(
        python(
            "train_ddp.py",
            *mnist_args(mnist_dir),
            *EQUIVALENCE,
            *LAYOUTS["ddp-1"][2],
            "--init-from",
            directory / "trained.pt",
            "--save",
            directory / "reference.pt",
        )
    )
    assert f"initialised the model from {directory / 'trained.pt'}" in run.output
    return directory


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(name, marks=[] if name == "fsdp-2" else pytest.mark.slow)
        for name in LAYOUTS
        if name != "ddp-1"
    ],
)
def test_every_strategy_starts_from_the_file_as_one_process_does(
    layout, trained, reference, mnist_dir, tmp_path
):
    """24 fp64 steps from the file's weights: FSDP on 2 ranks, 2 pipeline stages, TP 2 (FSDP's reads
    the .safetensors copy) end where one process ends (1e-16 apart here), and far from where one
    process ends without the file."""
    script, ranks, flags = LAYOUTS[layout]
    source = trained / ("trained.safetensors" if layout == "fsdp-2" else "trained.pt")
    succeeded(
        torchrun(
            script,
            ranks,
            *mnist_args(mnist_dir),
            *EQUIVALENCE,
            *flags,
            "--init-from",
            source,
            "--save",
            tmp_path / "final.pt",
        )
    )
    # conftest's: the same one-process run without --init-from, from BabyCNN's seeded weights
    control = reference
    reference, initial = (
        load_weights(trained / "reference.pt"),
        load_weights(trained / "trained.pt"),
    )
    assert relative_difference(control, reference, initial) > CONTROL_FLOOR
    assert relative_difference(load_weights(tmp_path / "final.pt"), reference, initial) < TOLERANCE


@pytest.mark.slow  # four launches
def test_a_file_that_does_not_fit_is_one_line_and_a_checkpoint_wins_over_it(
    trained, mnist_dir, tmp_path
):
    wide = tmp_path / "wide.pt"
    torch.save(
        {
            name: torch.zeros(2, *t.shape[1:]) if name == "blocks.0.conv1.weight" else t
            for name, t in load_weights(trained / "trained.pt").items()
        },
        wide,
    )
    run = launch(
        "train_fsdp.py", 2, *mnist_args(mnist_dir), "--max-steps", "2", "--init-from", wide
    ).wait()
    assert_one_line_error(
        run,
        f"--init-from {wide} does not fit this model: blocks.0.conv1.weight is [2, 1, 3, 3] "
        "there, [8, 1, 3, 3] here",
    )
    args = [
        *mnist_args(mnist_dir),
        "--checkpoint-every",
        "2",
        "--no-eval",
        "--checkpoint-dir",
        tmp_path / "ck",
        "--init-from",
        trained / "trained.pt",
    ]
    succeeded(python("train_ddp.py", *args, "--max-steps", "4"))
    run = succeeded(
        python("train_ddp.py", *args, "--max-steps", "6")
    )  # a requeued job: it resumes at step 4
    assert f"resumed from {tmp_path / 'ck'}/step-4 " in run.output
    assert (
        f"--init-from {trained / 'trained.pt'} is not used: the checkpoint is newer" in run.output
    )


@pytest.mark.slow  # in CI's slow stage, for the README's 8 minutes
def test_an_init_from_file_missing_or_unreadable_is_named_with_its_os_error(mnist_dir, tmp_path):
    """--init-from's file missing (exit 2), unreadable (chmod 000, bound by permissions: exit 2) or
    failing with a real I/O error (a symlink to /proc/self/mem, whose read fails with EIO: exit 75,
    for a retry): each one line naming the file and the error, never "not a file of weights"."""
    from test_bad_input import bound_by_permissions

    missing, unreadable, eio = (
        tmp_path / "missing.pt",
        tmp_path / "unreadable.pt",
        tmp_path / "eio.pt",
    )
    torch.save({}, unreadable)
    unreadable.chmod(0)
    eio.symlink_to("/proc/self/mem")
    args = [*mnist_args(mnist_dir), "--max-steps", "2", "--init-from"]
    runs = [launch("train_ddp.py", 2, *args, path) for path in (missing, eio)]
    runs.append(bound_by_permissions(["bash", ROOT / "run_ddp.sh", *args, unreadable]))
    assert_one_line_error(
        runs[0].wait(),
        f"--init-from: {missing} cannot be read (No such file or directory): fix it, or the path",
    )
    assert runs[1].wait().returncode == 75, runs[1].output
    assert (
        f"error: --init-from: reading {eio} failed (Input/output error); it may pass on a retry"
        in runs[1].output
    ), runs[1].output
    assert_one_line_error(
        runs[2].wait(), f"--init-from: {unreadable} cannot be read (Permission denied)"
    )
    assert "not a file of weights" not in "".join(run.output for run in runs)
