"""Bad input, every case in one table: one `error:` line from rank 0, exit code 2, nothing written.

A case is one line: (script, processes, flags, the error line it must give). One process where the
world size does not matter. All cases start at once and fail within seconds, before any training
(except the diverging one, which stops at its first logging window).

Two tables of the same kind live beside what they need: bad launcher variables (an environment, not
flags) in test_launch.py, and bad checkpoints (made from its uninterrupted runs) in test_checkpoint.py.
"""

import os

import pytest
import torch

from conftest import _write_idx, assert_one_line_error, launch, mnist_args
from models.data import synthetic_digits

CASES = {
    # flags
    "zero-batch": ("train_ddp.py", 1, ["--dataset", "synthetic", "--batch-size", "0"],
                   "argument --batch-size: must be at least 1, got 0"),
    "unknown-dataset": ("train_ddp.py", 1, ["--dataset", "imagenet"], "argument --dataset: invalid choice: 'imagenet'"),
    "weight-decay-nan": ("train_ddp.py", 1, ["--weight-decay", "nan"],
                         "argument --weight-decay: must be at least 0, got nan"),
    "weight-decay-negative": ("train_ddp.py", 1, ["--weight-decay", "-1"],
                              "argument --weight-decay: must be at least 0, got -1"),
    "momentum-negative": ("train_ddp.py", 1, ["--momentum", "-1"], "argument --momentum: must be at least 0 and below 1, got -1"),
    "replicate-degree-0": ("train_fsdp.py", 1, ["--replicate-degree", "0"],
                           "argument --replicate-degree: must be at least 1, got 0"),
    "stages-per-rank-0": ("train_pippy.py", 1, ["--stages-per-rank", "0"],
                          "argument --stages-per-rank: must be at least 1, got 0"),
    # layouts and devices
    "batch-over-shard": ("train_ddp.py", 2, [*mnist_args("{mnist}"), "--batch-size", "321"],
                         "is more than the 320 samples each of the 2 ranks gets"),
    # The suite hides the GPUs (conftest.child_env), so every rank finds none; on a GPU node the same check
    # stops, in one line per node, more processes than GPUs.
    "cuda-without-gpus": ("train_ddp.py", 2, ["--dataset", "synthetic", "--device", "cuda"],
                          "2 processes on this node need 2 GPUs, but torch sees 0"),
    # output paths, checked at start-up
    "unwritable-save": ("train_ddp.py", 1, ["--dataset", "synthetic", "--save", "{tmp}"], "--save {tmp}: cannot write there"),
    "save-is-metrics": ("train_ddp.py", 1, ["--dataset", "synthetic", "--save", "{tmp}/run", "--metrics", "{tmp}/run"],
                        "--save and --metrics are both {tmp}/run: the metrics would replace the weights"),
    "checkpoint-dir-is-a-file": ("train_ddp.py", 1, ["--dataset", "synthetic", "--checkpoint-dir", "{tmp}/file"],
                                 "--checkpoint-dir {tmp}/file: cannot write there (it is a file, not a directory)"),
    # data
    "missing-mnist": ("train_ddp.py", 1, [*mnist_args("{tmp}/missing")], "put the files in {tmp}/missing/MNIST/raw/"),
    "label-255": ("train_ddp.py", 1, [*mnist_args("{bad}/label-255")], "train-labels-idx1-ubyte has label 255 at index 0; "
                  "mnist labels are 0 to 9"),
    "fewer-labels": ("train_ddp.py", 1, [*mnist_args("{bad}/fewer-labels")],
                     "train-labels-idx1-ubyte holds 639 labels for the 640 images"),
    "no-labels": ("train_ddp.py", 1, [*mnist_args("{bad}/no-labels")], "train-labels-idx1-ubyte holds 0 labels for the 640 images"),
    "random-bytes": ("train_ddp.py", 1, [*mnist_args("{bad}/random-bytes")],
                     "train-images-idx3-ubyte is not an IDX file of 3-D uint8 data"),
    "truncated-images": ("train_ddp.py", 1, [*mnist_args("{bad}/truncated-images")], "train-images-idx3-ubyte is truncated"),
    # training
    "diverged": ("train_ddp.py", 1, [*mnist_args("{mnist}"), "--lr", "1e30", "--max-steps", "5", "--log-every", "1",
                                     "--no-eval", "--save", "{tmp}/diverged.pt"], "training diverged; lower --lr"),
}


def bad_mnist(root):
    """One MNIST directory per kind of damage, each otherwise valid (640 training, 300 test images)."""
    (train_x, train_y), (test_x, test_y) = synthetic_digits(640, seed=10), synthetic_digits(300, seed=11)
    damage = {
        "label-255": lambda files: files["train-labels-idx1-ubyte"].__setitem__(0, 255),
        "fewer-labels": lambda files: files.__setitem__("train-labels-idx1-ubyte", train_y[:-1]),
        "no-labels": lambda files: files.__setitem__("train-labels-idx1-ubyte", train_y[:0]),
        "random-bytes": None,
        "truncated-images": None,
    }
    for name, change in damage.items():
        raw = root / name / "MNIST" / "raw"
        raw.mkdir(parents=True)
        files = {"train-images-idx3-ubyte": train_x[:, 0], "train-labels-idx1-ubyte": train_y.clone(),
                 "t10k-images-idx3-ubyte": test_x[:, 0], "t10k-labels-idx1-ubyte": test_y}
        if change:
            change(files)
        for file, tensor in files.items():
            _write_idx(raw / file, tensor)
    images = root / "random-bytes" / "MNIST" / "raw" / "train-images-idx3-ubyte"
    noise = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    images.write_bytes(noise.numpy().tobytes())
    images = root / "truncated-images" / "MNIST" / "raw" / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:-1000])


@pytest.fixture(scope="module")
def runs(mnist_dir, tmp_path_factory):
    tmp, bad = tmp_path_factory.mktemp("bad-input"), tmp_path_factory.mktemp("bad-mnist")
    (tmp / "file").write_text("not a directory")
    bad_mnist(bad)
    fill = {"tmp": str(tmp), "mnist": str(mnist_dir), "bad": str(bad)}
    started = {case: launch(script, processes, *[str(a).format(**fill) for a in flags])
               for case, (script, processes, flags, _) in CASES.items()}
    return started, fill


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_from_rank_zero(case, runs):
    started, fill = runs
    run = started[case].wait()
    assert_one_line_error(run, CASES[case][3].format(**fill))
    assert run.returncode == 2 or CASES[case][1] > 1  # torchrun reports its workers' failure as 1
    assert not os.path.exists(os.path.join(fill["tmp"], "diverged.pt"))  # a diverged run saves nothing
    assert not os.path.exists(os.path.join(fill["tmp"], "run"))
