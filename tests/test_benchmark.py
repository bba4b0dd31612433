"""The benchmark at its smallest size: every figure present and sane, the plot written."""

import json
import math
import sys

from conftest import ROOT, Run


def test_quick_benchmark_reports_every_figure(tmp_path):
    run = Run([sys.executable, ROOT / "benchmarks" / "compare.py", "--quick", "--out", tmp_path]).wait(timeout=600)
    assert run.returncode == 0, run.output[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    figures = [
        results["overhead"]["ddp_1"], results["overhead"]["bare_loop"], results["overhead"]["ratio"],
        results["data_path"]["device_loader_samples_per_second"], results["data_path"]["dataloader_samples_per_second"],
        results["scaling"]["ddp"]["ddp_2"], results["scaling"]["fsdp"]["fsdp_2"], results["scaling"]["ceiling"]["two_bare_loops"],
        *(results["scaling"][s][k] for s in ("ddp", "fsdp", "ceiling") for k in ("ratio", "ratio_min", "ratio_max")),
        *(results["scaling"]["ddp_step"][k] for k in ("compute_ms", "wait_ms", "allreduce_ms", "idle_allreduce_ms", "idle_allreduce_one_float_ms")),
        results["memory"]["ddp_state_bytes"],
        *(row[k] for row in results["memory"]["fsdp"].values() for k in ("max_state_bytes", "ratio_to_ddp_over_n")),
        *(row[k] for row in results["pipeline"]["rows"] for k in ("measured_step_seconds", "ideal_step_seconds", "ratio", "bubble_fraction")),
    ]
    assert all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in figures), figures
    assert sorted(results["memory"]["fsdp"]) == ["1", "2"]
    assert {row["schedule"] for row in results["pipeline"]["rows"]} == {"gpipe", "1f1b"}
    # FSDP's shards are measured, not assumed: at N ranks each holds about 1/N of DDP's state.
    assert results["memory"]["fsdp"]["2"]["ratio_to_ddp_over_n"] < 1.1
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "results.png").stat().st_size > 10_000
    assert run.output.count("| 5. pipeline") == 2 and "[1/" in run.output  # the table, and a progress line per run
