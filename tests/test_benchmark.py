"""The benchmark at its smallest size: every figure present and sane, the plot written; what it says
when a configuration fails, and what it leaves behind. And the other files of benchmarks/ and the
pages' generators in docs/ that no other test runs, each at its smallest.

The benchmark's runs are the scripts the other files test, measured: these tests are marked slow
(minutes of launches) and left out of the default run, and pages (their figures are quoted): CI runs
them with `-m pages`."""

import json
import math
import os
import re
import sys

import pytest
import torch
from conftest import ROOT, Run, child_env

from benchmarks import compare

COMPARE = ROOT / "benchmarks" / "compare.py"


@pytest.mark.slow
@pytest.mark.pages
def test_quick_benchmark_reports_every_figure(tmp_path):
    scratch = tmp_path / "tmp"  # the benchmark's temporary directory, alone in its own
    scratch.mkdir()
    run = Run(
        [sys.executable, COMPARE, "--quick", "--out", tmp_path], env=child_env(TMPDIR=scratch)
    ).wait(timeout=600)
    assert run.returncode == 0, run.output[-3000:]
    assert list(scratch.glob("bench-*")) == []  # the runs' metrics files went with it
    results = json.loads((tmp_path / "results.json").read_text())
    figures = [
        results["overhead"]["ddp_1"],
        results["overhead"]["bare_loop"],
        results["overhead"]["ratio"],
        results["data_path"]["device_loader_samples_per_second"],
        results["data_path"]["dataloader_samples_per_second"],
        results["scaling"]["ddp"]["ddp_2"],
        results["scaling"]["fsdp"]["fsdp_2"],
        results["scaling"]["ceiling"]["two_bare_loops"],
        results["scaling"]["tp"]["tp_2"],
        *(
            results["scaling"][s][k]
            for s in ("ddp", "fsdp", "tp", "ceiling")
            for k in ("ratio", "ratio_min", "ratio_max")
        ),
        *(
            results["scaling"]["ddp_step"][k]
            for k in (
                "compute_ms",
                "wait_ms",
                "allreduce_ms",
                "idle_allreduce_ms",
                "idle_allreduce_one_float_ms",
            )
        ),
        results["memory"]["ddp_state_bytes"],
        *(
            row[k]
            for kind in ("fsdp", "tp")
            for row in results["memory"][kind].values()
            for k in ("max_state_bytes", "ratio_to_ddp_over_n")
        ),
        *(
            row[k]
            for row in results["pipeline"]["rows"]
            for k in ("measured_step_seconds", "ideal_step_seconds", "ratio", "bubble_fraction")
        ),
    ]
    assert all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in figures), figures
    assert sorted(results["memory"]["fsdp"]) == ["1", "2"] and sorted(results["memory"]["tp"]) == [
        "2"
    ]
    assert {row["schedule"] for row in results["pipeline"]["rows"]} == {"gpipe", "1f1b"}
    # FSDP's shards are measured, not assumed: at N ranks each holds about 1/N of DDP's state.
    assert results["memory"]["fsdp"]["2"]["ratio_to_ddp_over_n"] < 1.1
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "results.png").stat().st_size > 10_000
    assert (
        run.output.count("| 5. pipeline") == 2 and "[1/" in run.output
    )  # the table, and a progress line per run


@pytest.mark.slow
@pytest.mark.pages
def test_host_overhead_reports_the_cost_of_a_step_and_of_the_start(tmp_path):
    run = Run(
        [
            sys.executable,
            ROOT / "benchmarks" / "host_overhead.py",
            "--steps",
            "200",
            "--repeats",
            "1",
            "--out",
            tmp_path,
        ]
    ).wait(timeout=600)
    assert run.returncode == 0, run.output[-3000:]
    results = json.loads((tmp_path / "host_overhead.json").read_text())
    figures = [
        results[k]
        for k in (
            "bare_loop",
            "bare_loop_ddp",
            "train_ddp",
            "import_torch_seconds",
            "first_step_seconds",
        )
    ]
    assert all(math.isfinite(v) and v > 0 for v in figures), figures
    assert list(tmp_path.glob(".host_overhead*")) == []  # its scratch metrics file went with it
    assert "| train_ddp.py, one process |" in run.output


def test_figure_6_alone_without_a_gpu_is_one_line(tmp_path):
    run = Run(
        [sys.executable, COMPARE, "--only", "gpu", "--out", tmp_path]
    ).wait()  # child_env hides any GPU
    assert run.returncode == 2
    assert run.output.strip() == (
        "error: --only gpu measures figure 6 on GPUs, and torch sees none here "
        "(torch.cuda.device_count() is 0)"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(
    torch.cuda.device_count() == 0, reason="no CUDA GPU visible to torch: figure 6 needs one"
)
def test_figure_6_alone_on_a_gpu(tmp_path):
    env = child_env()
    env.pop(
        "CUDA_VISIBLE_DEVICES"
    )  # child_env hides the GPUs from the CPU suite; this run needs them
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    run = Run(
        [sys.executable, COMPARE, "--only", "gpu", "--quick", "--out", tmp_path], env=env
    ).wait(timeout=600)
    assert run.returncode == 0, run.output[-3000:]
    results = json.loads((tmp_path / "gpu.json").read_text())
    assert (
        "overhead" not in results and not (tmp_path / "results.json").exists()
    )  # figures 1 to 5 did not run
    rows = results["gpu"]["rows"]
    assert len(rows) == 10 and all(row["samples_per_second"] > 0 for row in rows), rows
    assert "[10/10]" in run.output and "[11/" not in run.output
    assert (tmp_path / "gpu.md").read_text().count("| train_ddp.py (") == 6


@pytest.mark.slow
@pytest.mark.pages
def test_a_failing_configuration_says_its_own_error_and_leaves_no_scratch_directory(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    # The first configuration, the bare loop, cannot make -1 batches: a Python traceback of its own.
    run = Run(
        [sys.executable, COMPARE, "--quick", "--steps", "-1", "--out", tmp_path / "out"],
        env=child_env(TMPDIR=scratch),
    ).wait()
    assert run.returncode == 1, run.output[-3000:]
    assert (
        "bare_loop.py --steps -1 --batch-size 64 failed:\nTraceback (most recent call last):"
        in run.output
    )
    assert "RuntimeError: Trying to create tensor with negative dimension -64" in run.output
    assert list(scratch.glob("bench-*")) == []
    assert not (tmp_path / "out" / "results.json").exists()


# torchrun ends a failed run's stderr with its own traceback and a ChildFailedError block, over
# 2,000 characters that name no cause; the failing rank's error comes before them.
TORCHRUN_SUMMARY = ("ChildFailedError", "=" * 60, "Root Cause", "torch/distributed/run.py")


def failure_message(command):
    """What compare.py reports when ``command``, a configuration, fails."""
    with pytest.raises(SystemExit) as stopped:
        compare.launch(command, timeout=120)
    return str(stopped.value.code)


@pytest.mark.slow
@pytest.mark.pages
def test_a_failed_configuration_reports_the_scripts_error_line_not_torchruns_summary():
    message = failure_message(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            ROOT / "train_ddp.py",
            "--epochs",
            "0",
        ]
    )
    assert (
        "error: argument --epochs: must be at least 1, got 0 (see --help)" in message.splitlines()
    )
    assert re.search(r"^torchrun: rank [01] failed first, exit code 2$", message, re.M), message
    assert not [text for text in TORCHRUN_SUMMARY if text in message], message
    assert "Traceback" not in message, message


@pytest.mark.slow
@pytest.mark.pages
def test_the_error_line_comes_from_the_failed_rank_when_torchrun_stops_rank_0_first(tmp_path):
    """The race a CI run lost: rank 1 fails first, and torchrun stops rank 0 before it prints its
    `error:` line. The line then comes from rank 1's error file, which torchrun's summary quotes."""
    script = tmp_path / "rank_0_late.py"
    script.write_text(
        "import os, time\n"
        "from plumbing import failures\n"
        "def main():\n"
        "    if os.environ['RANK'] == '0':\n"
        "        time.sleep(60)  # torchrun stops it first\n"
        "    raise failures.UsageError('rank 1 says why')\n"
        "failures.run(main)\n"
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    message = failure_message([*command, script])
    assert "error: rank 1 says why" in message.splitlines(), message
    assert re.search(r"^torchrun: rank 1 failed first, exit code 2$", message, re.M), message


@pytest.mark.slow
@pytest.mark.pages
def test_a_failed_configuration_reports_the_traceback_of_the_rank_that_failed_first(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text("""
import sys
import time

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise ValueError("no batch for step 7")
try:
    dist.barrier()  # fails once rank 1 is gone: a later traceback, of no interest
except RuntimeError:
    # printed as an uncaught one would be, while this rank stays alive
    sys.excepthook(*sys.exc_info())
    time.sleep(60)  # until torchrun, having seen rank 1 fail first, stops it
""")
    message = failure_message(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            worker,
        ]
    )
    lines = message.splitlines()
    assert lines[1:] == [
        "[rank1]: Traceback (most recent call last):",
        f'[rank1]:   File "{worker}", line 9, in <module>',
        '[rank1]:     raise ValueError("no batch for step 7")',
        "[rank1]: ValueError: no batch for step 7",
        "torchrun: rank 1 failed first, exit code 1",
    ], message
    assert lines[0].endswith(f"{worker} failed:")
    assert not [text for text in TORCHRUN_SUMMARY if text in message], message


@pytest.mark.slow
@pytest.mark.pages
def test_watch_overhead_reports_both_runs_and_the_host_cost_and_the_plot_reads_the_csv(tmp_path):
    run = Run(
        [
            sys.executable,
            ROOT / "docs" / "watch_overhead.py",
            "--pairs",
            "1",
            "--steps",
            "100",
        ]
    ).wait()
    assert run.returncode == 0, run.output[-3000:]
    result = json.loads(run.output.strip().splitlines()[-1])
    rates, host = result["median_samples_per_second"], result["host_us_per_step"]
    assert rates["bar_and_log_dir"] > 0 and rates["neither"] > 0 and result["ratio"] > 0
    assert (
        host["bar_and_log_dir"] > host["neither"] > 0
    )  # the bar and the rows cost something, measured apart
    log = tmp_path / "log"
    log.mkdir()
    (log / "metrics.csv").write_text(
        "step,epoch,train_loss,lr,grad_norm,samples_per_second,test_loss,test_accuracy\n"
        "10,1,2.0,0.001,,100.0,,\n20,1,1.0,0.002,,110.0,,\n20,1,,,,,0.9,0.7\n"
    )
    plot = Run(
        [sys.executable, ROOT / "benchmarks" / "plot_log.py", log, tmp_path / "plot.png"]
    ).wait()
    assert plot.returncode == 0 and (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG", (
        plot.output
    )


@pytest.mark.slow
@pytest.mark.pages
def test_gpt_time_to_loss_times_the_launch_to_each_evaluation(tmp_path):
    # 20 steps through the launcher on 2 processes: one evaluation, at the end. The control: the
    # untrained GPT's loss is ln(65) = 4.17; a target of 4.0 is reached (and timed) only if it
    # learned, and 1.9 is not reached in 20 steps.
    flags = ["--", "--max-steps", "20", "--warmup-steps", "2", "--log-every", "10"]
    results = {}
    for target in (4.0, 1.9):
        out = tmp_path / f"{target}.json"
        command = [sys.executable, ROOT / "docs" / "gpt_time_to_loss.py", "--out", out]
        run = Run([*command, "--target", target, *flags]).wait(timeout=600)
        assert run.returncode == 0, run.output[-3000:]
        assert f"wrote {out}" in run.output
        results[target] = json.loads(out.read_text())
    reached, missed = results[4.0], results[1.9]
    assert reached["command"].endswith(
        "bash run_ddp.sh --model gpt --max-steps 20 --warmup-steps 2 --log-every 10"
    )
    start = reached["start"]
    assert "2 rank(s)" in start["line"] and "shakespeare; 20 steps" in start["line"]
    (point,) = reached["evaluations"]
    assert point["step"] == 20 and 2.0 < point["val_loss"] < 4.0 < math.log(65)
    assert reached["reached"] and reached["wall_seconds_to_target"] == point["wall_seconds"]
    assert 0 < start["wall_seconds"] < point["wall_seconds"] <= reached["wall_seconds"]
    assert 0 < start["cpu_seconds_busiest_process"] < point["cpu_seconds_busiest_process"]
    busiest, everyone = point["cpu_seconds_busiest_process"], point["cpu_seconds_all"]
    assert 0 < busiest < everyone <= reached["cpu_seconds_all"]  # 2 ranks, torchrun, the shell
    assert reached["cpu_seconds_to_target_busiest_process"] == busiest
    assert not missed["reached"] and missed["wall_seconds_to_target"] is None
    assert missed["final_val_loss"] > 1.9 and reached["wrote_text"] and missed["wrote_text"]
    loads = reached["load_average_1min"]
    assert all(math.isfinite(v) and v >= 0 for v in loads.values()) and reached["cores"] >= 1


def last_json_line(output):
    return json.loads([line for line in output.splitlines() if line.startswith("{")][-1])


@pytest.mark.slow
@pytest.mark.pages
def test_fsdp_memory_counts_the_activations_the_fsdp_page_quotes():
    # docs/sharding.py's activations rows, as it makes them: benchmarks/fsdp_memory.py at width 1
    # and batch 64 on 2 ranks, without and with activation checkpointing. Tensor bytes do not move
    # from run to run: equal to the committed results and to docs/fsdp.md's "1.0 MiB ... instead of
    # 7.5", "9.1 to 6.9". (Its 17 runs whole take minutes: the committed table is rendered.)
    from docs import sharding

    committed = json.loads((ROOT / "docs" / "results" / "sharding.json").read_text())
    for row, flags in zip(committed["activations"], ([], ["--activation-checkpointing"])):
        counted = sharding.tensors(2, ["--width", "1", "--batch-size", "64", *flags], 300)
        assert row["activation_checkpointing"] == bool(flags), row
        assert counted["after_forward"]["act"] == row["kept_for_backward_bytes"], counted
        assert counted["peak"]["total"] == row["peak_tensor_bytes"], counted
    kept = [row["kept_for_backward_bytes"] for row in committed["activations"]]
    peak = [row["peak_tensor_bytes"] for row in committed["activations"]]
    assert [round(n / 2**20, 1) for n in (*kept, *peak)] == [7.5, 1.0, 9.1, 6.9]
    table = sharding.markdown(committed)  # the page's tables, from the committed results
    assert all(f"| {row['layout']} |" in table for row in committed["memory"]), table
    assert "with --activation-checkpointing" in table, table


@pytest.mark.slow
@pytest.mark.pages
def test_lr_scaling_runs_its_four_runs_and_draws_them(tmp_path, mnist_dir):
    # The four runs on the small MNIST, one epoch: batch 512 is one step of it; no warmup fits.
    small = ["--dataset", "mnist", "--data-dir", mnist_dir, "--no-download"]
    command = [sys.executable, ROOT / "docs" / "lr_scaling.py", "--epochs", "1", "--out", tmp_path]
    run = Run([*command, "--", *small, "--warmup-steps", "0", "--log-every", "1"]).wait(600)
    assert run.returncode == 0, run.output[-3000:]
    runs = json.loads((tmp_path / "lr_scaling.json").read_text())["runs"]
    assert [(name, r["global_batch_size"], r["steps"]) for name, r in runs.items()] == [
        ("base", 64, 10),
        ("unscaled", 512, 1),
        ("scaled", 512, 1),
        ("warmup", 512, 1),
    ]
    assert runs["scaled"]["lr"] == 8 * runs["unscaled"]["lr"] == 8 * runs["base"]["lr"]
    assert all(0 < r["epochs"][0]["test_accuracy"] <= 1 for r in runs.values()), runs
    assert (tmp_path / "lr_scaling.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.pages
def test_time_to_accuracy_reads_each_scripts_epochs(tmp_path, mnist_dir):
    small = ["--dataset", "mnist", "--data-dir", mnist_dir, "--no-download"]
    command = [sys.executable, ROOT / "docs" / "time_to_accuracy.py", "--epochs", "2"]
    run = Run([*command, "--out", tmp_path, "--", *small]).wait(timeout=600)
    assert run.returncode == 0, run.output[-3000:]
    rows = json.loads((tmp_path / "time_to_accuracy.json").read_text())["rows"]
    assert [r["script"] for r in rows] == ["train_ddp.py", "train_fsdp.py", "train_pippy.py"]
    for row in rows:  # 640 images: a few steps an epoch
        (e1, s1, t1, a1), (e2, s2, t2, a2) = row["per_epoch"]
        assert (e1, e2, s2) == (1, 2, 2 * s1) and s1 > 0 and 0 < t1 < t2, row
        assert 0 <= a1 <= 100 and 0 <= a2 <= 100 and row["final_accuracy"] == a2
        assert row["seconds_to_99"] is None  # 640 images do not reach 99 %
    assert (tmp_path / "time_to_accuracy.md").read_text().count("| train_") == 3


@pytest.mark.slow
@pytest.mark.pages
def test_failure_detection_times_a_killed_rank_and_torchruns_end():
    command = [sys.executable, ROOT / "docs" / "failure_detection.py", "--trials", "1"]
    run = Run([*command, "--train-seconds", "0.5"]).wait(timeout=300)
    assert run.returncode == 0, run.output[-3000:]
    (trial,) = last_json_line(run.output)["trials"]
    assert trial["torchrun_exit_code"] not in (0, None), trial  # rank 1 died: the job failed
    assert 0 < trial["rank0_exit_s"] <= trial["torchrun_exit_s"] < 120, trial
    assert "| torchrun's exit |" in run.output
