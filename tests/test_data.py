"""The MNIST files that ship in models/mnist/: byte-identical to the originals, read offline by
--dataset auto."""

import gzip
import hashlib
import json
import re
import shutil

import pytest
import torch
from conftest import ROOT, mnist_args, python, succeeded

from models import data

BUNDLED = ROOT / "models" / "mnist"
SHARED = (
    ROOT.parent / "shared" / "data" / "mnist" / "README.md"
)  # where the files came from, beside the checkout


def checksums(readme):
    """{file: (bytes, md5 of the uncompressed file)} from a README's table."""
    rows = re.findall(
        r"^\| ([a-z0-9-]+-ubyte) \| ([\d,]+) \| ([0-9a-f]{32}) \|$", readme.read_text(), re.M
    )
    return {name: (int(size.replace(",", "")), md5) for name, size, md5 in rows}


def test_the_bundled_files_are_the_original_mnist():
    table = checksums(BUNDLED / "README.md")
    assert sorted(table) == sorted(data._IDX)
    for name, (size, md5) in table.items():
        raw = gzip.decompress((BUNDLED / f"{name}.gz").read_bytes())
        assert (len(raw), hashlib.md5(raw).hexdigest()) == (size, md5), name
    if SHARED.exists():  # the checkout's own table is the one the files came with
        assert checksums(SHARED) == table
    found = data.find("auto", None, download=False)
    (train_images, train_labels), (test_images, test_labels) = found["splits"]
    assert train_images.shape == (60000, 1, 28, 28) and test_images.shape == (10000, 1, 28, 28)
    counts = re.search(
        r"training set \(digits 0–9\): ([\d ]+);\s+test set: ([\d ]+)\.",
        (BUNDLED / "README.md").read_text(),
    )
    assert train_labels.bincount().tolist() == [int(n) for n in counts.group(1).split()]
    assert test_labels.bincount().tolist() == [int(n) for n in counts.group(2).split()]


def test_auto_trains_on_the_bundled_digits_with_no_network_and_no_data_dir(tmp_path):
    metrics = tmp_path / "metrics.json"
    run = succeeded(
        python(
            "train_ddp.py",
            "--no-download",
            "--max-steps",
            "30",
            "--log-every",
            "10",
            "--no-eval",
            "--metrics",
            metrics,
        )
    )
    assert "; mnist; 30 steps" in run.output
    assert json.loads(metrics.read_text())["dataset"] == "mnist"
    # A --data-dir would not be read: refused (before any process group), not passed over.
    with pytest.raises(
        data.DataError,
        match=r"^--data-dir mine is not read with --dataset auto, which trains on the "
        r"MNIST files in .*models/mnist: add --dataset mnist to train on the MNIST "
        r"files in mine$",
    ):
        data.find("auto", "mine")


@pytest.mark.parametrize("compressed", [True, False])
def test_a_copy_of_the_original_files_reads_as_distributed_gzip_or_not(compressed, tmp_path):
    # The four files alone in --data-dir, as the MNIST page distributes them (or gunzipped): no
    # MNIST/raw/ layout.
    for name in data._IDX:
        if compressed:
            shutil.copy(BUNDLED / f"{name}.gz", tmp_path / f"{name}.gz")
        else:
            (tmp_path / name).write_bytes(gzip.decompress((BUNDLED / f"{name}.gz").read_bytes()))
    found = data.find("mnist", tmp_path, download=False)
    assert found["missing"] is None and found["broken"] is None
    assert found["splits"][0][0].shape == (60000, 1, 28, 28)


def test_a_damaged_archive_is_named_as_one(mnist_dir, tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    shutil.copytree(mnist_dir / "MNIST" / "raw", raw)
    images = raw / "train-images-idx3-ubyte"
    compressed = gzip.compress(images.read_bytes())
    images.unlink()
    (raw / "train-images-idx3-ubyte.gz").write_bytes(
        compressed[: len(compressed) // 2]
    )  # cut short
    run = python("train_ddp.py", *mnist_args(tmp_path)).wait()
    assert run.returncode == 2
    assert f"error: {raw / 'train-images-idx3-ubyte.gz'} is a damaged gzip archive" in run.output, (
        run.output
    )


def test_a_float64_models_normalisation_does_not_depend_on_the_summation_order(mnist_dir):
    """Issue 53: a GPU run in float64 parted from the CPU reference by 4e-8, because the inputs'
    statistics were summed in float32 on each device, in its own order. The bundled training
    images (the tests' 640), summed in another order (reversed), give float64 statistics within
    1e-10 of the first (2e-13 measured); the control, the float32 statistics, sit 5e-8 from them,
    as the GPU's run sat from the CPU's."""
    images = data.find("mnist", mnist_dir, download=False)["splits"][0][0]  # the tests' 640
    scale, shift = data.normalisation(images, torch.float64)
    again = data.normalisation(images.flip(0), torch.float64)
    apart = max(((a - b) / b).abs().item() for a, b in zip(again, (scale, shift)))
    single = data.normalisation(images, torch.float32)
    control = max(((a.double() - b) / b).abs().item() for a, b in zip(single, (scale, shift)))
    assert apart < 1e-10 < control / 100, (apart, control)
