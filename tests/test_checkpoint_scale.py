"""benchmarks/checkpoint_scale.py at its smallest size (one 4096 x 4096 layer, 2 ranks): every
figure present and sane, and its folder gone. A smoke run: its times are the benchmark's to print
(measurements.md quotes a 1 GB run), not a test's to hold."""

import json
import math

import pytest
from conftest import torchrun

LAYER = 3 * 4096 * 4096 * 4  # bytes: a layer's fp32 weight and AdamW's two moments


@pytest.mark.slow
def test_the_checkpoint_scale_benchmark_times_each_way_and_the_checks(tmp_path):
    folder, metrics = tmp_path / "ck", tmp_path / "scale.json"
    run = torchrun(
        "benchmarks/checkpoint_scale.py",
        2,
        *("--gigabytes", "0.2", "--repeats", "2", "--checkpoint-dir", folder),
        *("--metrics", metrics),
    ).wait(timeout=600)
    assert run.returncode == 0, run.output[-3000:]
    result = json.loads(metrics.read_text())
    assert result["ranks"] == 2 and result["layers"] == 1, result
    # the tensors, and a few KB of headers, random states, .metadata and checkpoint.json
    assert LAYER < result["checkpoint_bytes"] < LAYER * 1.001, result["checkpoint_bytes"]
    for name in ("dcp_save", "save", "dcp_load", "resume", "check", "check_sha256", "remove"):
        each = 4 if name.startswith("check") or name == "remove" else 2  # per step, or per way
        assert len(result["seconds_each"][name]) == each, name
        assert all(math.isfinite(s) and s > 0 for s in result["seconds_each"][name]), name
    assert result["save_ratio"] == result["save"] / result["dcp_save"]
    assert result["resume_ratio"] == result["resume"] / result["dcp_load"]
    assert not folder.exists()
