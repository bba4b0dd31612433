"""Measure the strategies side by side with the project's own scripts, in one run.

    python benchmarks/compare.py                      # about 11 minutes on a 2-core CPU machine
    python benchmarks/compare.py --quick              # the smallest size (the smoke test's)
    python benchmarks/compare.py --steps 2000 --width 32 --max-ranks 8   # on a GPU node
    python benchmarks/compare.py --only gpu  # figure 6 alone, on a GPU node

Every configuration runs the real script under torchrun (or plain python for the one-process
baseline) with one thread per process, on the synthetic set, with the same seed. Figures 1 to 5
are measured on the CPU (--device cpu), whatever the machine has; where torch sees GPUs, figure 6
measures the bare loop and the scripts on them. Prints a Markdown table and writes results.json,
results.md and results.png to --out (with --only gpu: gpu.json and gpu.md, beside a whole run's).
"""

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def launch(command, timeout, copies=1):
    """Run ``copies`` instances of a command at the same time; return the list of their outputs."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("RANK", None)
    command = [str(c) for c in command]
    processes = [
        subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(copies)
    ]
    outputs = []
    for process in processes:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            sys.exit(f"benchmark: {' '.join(command)} took more than {timeout} s")
        if process.returncode != 0:
            for other in processes:  # the other copies would run on after this process exits
                other.kill()
            sys.exit(f"benchmark: {' '.join(command)} failed:\n{failure(stderr)}")
        outputs.append(stdout)
    return outputs


# torchrun's own ending when a worker fails: its traceback (frames in torch/distributed/run.py),
# then a ChildFailedError block of `====` lines. It is over 2,000 characters, and names no cause.
CHILD_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
TORCHRUN_LOG = re.compile(
    r"[IWE]\d{4} [\d:.]+ +\d+ \S*torch/distributed/"
)  # its log lines (logging's glog format)
RANK_PREFIX = re.compile(
    r"\[rank(\d+)\]: ?"
)  # torch's on a worker's uncaught exception, once its process group exists
TRACEBACK = "Traceback (most recent call last):"
CHAINED = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)


def failure(stderr):
    """What a failed configuration's stderr says about why: its workers' `error:` lines (or the
    first failed rank's, from torchrun's summary, if torchrun stopped rank 0 before it said it) and
    the traceback of the rank torchrun names as the first failure (without `error:` lines, else
    the last traceback), then that rank's exit code; without torchrun's own traceback,
    ChildFailedError block and log lines."""
    lines = stderr.splitlines()
    root_rank = root_cause = None
    noted = ""  # the first failed rank's line, as its error file has it (failures.run writes it)
    ends = [i for i, line in enumerate(lines) if line.startswith(CHILD_FAILED)]
    if ends:
        start = max((i for i in range(ends[-1]) if lines[i] == TRACEBACK), default=ends[-1])
        summary, lines = lines[start:], lines[:start]
        first = summary[
            next((i for i, line in enumerate(summary) if line.startswith("Root Cause")), 0) :
        ]
        root_rank = next(
            (m.group(1) for line in first if (m := re.match(r"\s*rank\s*: (\d+)", line))), None
        )
        exit_code = next(
            (line.split(":", 1)[1] for line in first if re.match(r"\s*exitcode\s*:", line)), ""
        )
        noted = next(
            (
                line.split(":", 1)[1].strip()
                for line in first
                if re.match(r"\s*traceback\s*:", line)
            ),
            "",
        )
        if (
            root_rank is not None
        ):  # "exitcode  : -9 (pid: 123)  (SIGKILL)": the code, and the signal if any
            signal_name = "".join(
                f" ({name})" for name in re.findall(r"\((SIG\w+)\)", exit_code)[:1]
            )
            code = "".join(exit_code.split()[:1])
            root_cause = f"torchrun: rank {root_rank} failed first, exit code {code}{signal_name}"
    lines = [line for line in lines if not TORCHRUN_LOG.match(line)]
    errors = [line for line in lines if RANK_PREFIX.sub("", line, count=1).startswith("error:")]
    if not errors and noted.startswith("error:"):  # torchrun stopped rank 0 before it said it
        errors = [noted]
    # The workers' tracebacks, each rank's apart (torch prefixes its lines, and ranks interleave),
    # plain ones together.
    streams = {}
    for index, line in enumerate(lines):
        match = RANK_PREFIX.match(line)
        source, text = (match.group(1), line[match.end() :]) if match else (None, line)
        streams.setdefault(source, []).append((index, line, text))
    tracebacks = {}  # source: (position of its first line, its lines), the last traceback of each
    for source, stream in streams.items():
        starts = [i for i, (_, _, text) in enumerate(stream) if text == TRACEBACK]
        if starts:
            start = starts[-1]
            while start > 0 and any(
                text in CHAINED for _, _, text in stream[max(0, start - 2) : start]
            ):
                start = max(
                    (i for i in starts if i < start), default=0
                )  # a chained exception: from its first
            tracebacks[source] = (stream[start][0], [line for _, line, _ in stream[start:]])
    if root_rank in tracebacks:
        traceback = tracebacks[root_rank][1]
    else:
        # the project's `error:` lines say why on their own; a traceback of another rank would
        # follow from it
        traceback = [] if errors else max(tracebacks.values(), default=(None, []))[1]
    # Neither (a worker killed by a signal, a crash in C++): whatever else the workers wrote, at
    # most 20 lines.
    said = errors + traceback or [line for line in lines if line.strip()][-20:]
    kept = said + ([root_cause] if root_cause else [])
    return "\n".join(kept) if kept else stderr[-2000:]


class Bench:
    def __init__(self, args, scratch, total):
        self.args, self.scratch = args, scratch
        self.done, self.total, self.cache = 0, total, {}

    def progress(self, what):
        self.done += 1
        print(f"[{self.done}/{self.total}] {what}", flush=True)

    def train(self, script, ranks, *flags, repeat=0):
        """Run a training script under torchrun, or plain python for one process (once per
        configuration and repeat); return its metrics."""
        key = (script, ranks, *map(str, flags), repeat)
        if key not in self.cache:
            metrics = self.scratch / f"m{self.done}.json"
            common = ["--dataset", "synthetic", "--seed", "0", "--no-eval", "--metrics", metrics]
            if "--device" not in flags:
                common += ["--device", "cpu"]  # figures 1 to 5 are the CPU's, also on a GPU machine
            launcher = (
                ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
                if ranks > 1
                else []
            )
            command = [
                sys.executable,
                *launcher,
                ROOT / script,
            ]  # one process: plain python, as the README's first command
            self.progress(f"{script} on {ranks} process(es) {' '.join(map(str, flags))}")
            launch(command + common + [str(f) for f in flags], self.args.timeout)
            self.cache[key] = json.loads(metrics.read_text())
        return self.cache[key]

    def helper(self, name, *flags, copies=1, ranks=None):
        """Run a helper script (``copies`` of it at the same time, or under torchrun on ``ranks``
        processes); return its JSON line (a list for copies > 1)."""
        self.progress(
            f"benchmarks/{name} {' '.join(map(str, flags))}"
            + (f" ({copies} at once)" if copies > 1 else "")
            + (f" on {ranks} processes" if ranks else "")
        )
        launcher = (
            ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
            if ranks
            else []
        )
        outputs = launch(
            [sys.executable, *launcher, ROOT / "benchmarks" / name, *flags],
            self.args.timeout,
            copies,
        )
        parsed = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
        return parsed if copies > 1 else parsed[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smallest size: fewer steps, narrower model, fewer configurations",
    )
    parser.add_argument(
        "--only",
        choices=("gpu",),
        default=None,
        help="gpu: figure 6 alone (it needs a GPU), in gpu.json and gpu.md beside a whole run's "
        "results.*",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps per training run (default 200, quick 20)",
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--width",
        type=int,
        default=None,
        help="BabyCNN width for the memory figure (default 8, quick 1)",
    )
    parser.add_argument(
        "--max-ranks",
        type=int,
        default=None,
        help="largest world size for the memory figure (default 4, quick 2)",
    )
    parser.add_argument(
        "--microbatches",
        default=None,
        help="comma-separated microbatch counts (default 2,4,8,16; quick 4)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="rounds of the throughput runs (figures 1 and 3), interleaved; medians are reported "
        "(default 3, quick 1)",
    )
    parser.add_argument(
        "--gpu-steps",
        type=int,
        default=None,
        help="optimizer steps per GPU run (default 1000, quick 50)",
    )
    parser.add_argument(
        "--timeout", type=int, default=900, help="seconds one configuration may take"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    if args.only == "gpu" and not gpus:
        print(
            "error: --only gpu measures figure 6 on GPUs, and torch sees none here "
            "(torch.cuda.device_count() is 0)",
            file=sys.stderr,
        )
        sys.exit(2)
    cpu = args.only != "gpu"
    steps = args.steps or (20 if args.quick else 200)
    repeats = args.repeats or (1 if args.quick else 3)
    width = args.width or (1 if args.quick else 8)
    microbatches = [
        int(m) for m in (args.microbatches or ("4" if args.quick else "2,4,8,16")).split(",")
    ]
    ranks_for_memory = [
        n for n in (1, 2, 4, 8) if n <= (args.max_ranks or (2 if args.quick else 4))
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Configurations to run (identical ones run once: at width 1 the memory runs are the scaling
    # runs).
    tp_memory_runs = sum(
        n > 1 and 8 * width % n == 0 for n in ranks_for_memory
    )  # never the scaling run: --tp N
    total = (
        7 * repeats
        + 2
        + (1 + len(ranks_for_memory) if width > 1 else sum(n > 2 for n in ranks_for_memory))
        + tp_memory_runs
        + 3 * len(microbatches)
    )
    total = (total if cpu else 0) + (11 if gpus else 0)
    # The runs' metrics files go with the directory at the end, also when a configuration fails
    # (sys.exit).
    with tempfile.TemporaryDirectory(prefix="bench-") as scratch:
        bench = Bench(args, Path(scratch), total)
        results = {"machine": machine()}
        if cpu:
            results.update(
                cpu_figures(bench, args, steps, repeats, width, microbatches, ranks_for_memory)
            )
        # 6. GPUs, where there are any.
        if gpus:
            results["gpu"] = gpu_figures(
                bench, args.gpu_steps or (50 if args.quick else 1000), min(2, gpus)
            )

    ratios = [row["samples_per_second"] for row in results.get("gpu", {}).get("rows", [])]
    if cpu:
        ratios[:0] = [
            results["overhead"]["ratio"],
            results["data_path"]["ratio"],
            *(results["scaling"][k]["ratio"] for k in ("ddp", "fsdp", "tp", "ceiling")),
            *results["scaling"]["ddp_step"].values(),
            *(
                row["ratio_to_ddp_over_n"]
                for kind in ("fsdp", "tp")
                for row in results["memory"][kind].values()
            ),
            *(row["ratio"] for row in results["pipeline"]["rows"]),
        ]
    if not all(math.isfinite(v) and v > 0 for v in ratios):  # before anything is written
        sys.exit(f"benchmark: a figure is not a positive finite number: {ratios}")
    name = "results" if cpu else "gpu"  # figure 6 alone leaves a whole run's results.* as they are
    written = [out / f"{name}.json", out / f"{name}.md"]
    written[0].write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    written[1].write_text(table)
    if cpu:  # the plot draws figures 1, 3 and 4
        written.append(out / "results.png")
        plot(results, written[-1])
    print(table)
    print(f"wrote {', '.join(map(str, written))}")


def cpu_figures(bench, args, steps, repeats, width, microbatches, ranks_for_memory):
    """1 to 5, on the CPU: overhead, data path, scaling, memory, pipeline; with the loss curves the
    plot draws."""
    batch = ["--batch-size", args.batch_size, "--max-steps", steps, "--epochs", 1000]
    results = {"steps": steps, "batch_size": args.batch_size}

    # 1 and 3. Throughput, in rounds: each round runs every configuration once, back to back, and
    # its ratios compare runs of the same round. On a shared machine a neighbour's load moves one
    # run by 5% or more, so the table reports the median over the rounds and the spread of the
    # ratios.
    rounds = []
    for repeat in range(repeats):
        bare = bench.helper("bare_loop.py", "--steps", steps, "--batch-size", args.batch_size)
        two_bare = bench.helper(
            "bare_loop.py", "--steps", steps, "--batch-size", args.batch_size, copies=2
        )
        runs = {
            (strategy, ranks): bench.train(script, ranks, *batch, repeat=repeat)
            for strategy, script in (("ddp", "train_ddp.py"), ("fsdp", "train_fsdp.py"))
            for ranks in (1, 2)
        }
        runs["tp", 2] = bench.train(
            "train_tp.py", 2, *batch, repeat=repeat
        )  # one batch, each layer split in two
        rounds.append(
            {
                "bare_loop": bare["samples_per_second"],
                "two_bare_loops": sum(b["samples_per_second"] for b in two_bare),
                **{
                    f"{strategy}_{ranks}": run["samples_per_second"]
                    for (strategy, ranks), run in runs.items()
                },
            }
        )
        if repeat == 0:
            curves = {
                "ddp (2 ranks)": runs["ddp", 2]["loss_curve"],
                "fsdp (2 ranks)": runs["fsdp", 2]["loss_curve"],
            }

    def summary(numerator, denominator):
        ratios = [r[numerator] / r[denominator] for r in rounds]
        return {
            numerator: statistics.median(r[numerator] for r in rounds),
            denominator: statistics.median(r[denominator] for r in rounds),
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }

    results["repeats"] = repeats
    results["rounds"] = rounds
    # 1. Overhead: the script on one process against the bare loop over the same model.
    results["overhead"] = {**summary("ddp_1", "bare_loop"), "target": 0.95}

    # 2. Data path: on-device gather against torchvision Dataset + DataLoader + transforms.
    loaders = bench.helper(
        "data_path.py", "--batches", max(steps, 50), "--batch-size", args.batch_size
    )
    results["data_path"] = {
        **loaders,
        "ratio": loaders["device_loader_samples_per_second"]
        / loaders["dataloader_samples_per_second"],
    }

    # 3. Scaling: 2 processes against 1 (same per-rank batch), DDP and FSDP; TP on 2 against DDP on
    # 1 (the same batch, its layers split in two); and the machine's own ceiling: two bare loops at
    # once, which share the cores, caches and memory bandwidth but not a byte.
    results["scaling"] = {
        "ddp": summary("ddp_2", "ddp_1"),
        "fsdp": summary("fsdp_2", "fsdp_1"),
        "tp": summary("tp_2", "ddp_1"),
        "ceiling": summary("two_bare_loops", "bare_loop"),
        "target_ddp": 1.8,
    }
    # Where a 2-process DDP step's time goes: compute, waiting for the slower rank, the all-reduce.
    results["scaling"]["ddp_step"] = bench.helper(
        "ddp_sync.py", "--steps", steps, "--batch-size", args.batch_size, ranks=2
    )

    # 4. Memory: per-rank training state of a wide model, FSDP on N ranks against DDP.
    memory_steps = (
        batch
        if width == 1
        else ["--batch-size", 8, "--max-steps", 2, "--epochs", 1, "--width", width]
    )
    ddp_state = bench.train("train_ddp.py", 1, *memory_steps)["ranks"][0][
        "state_bytes"
    ]  # reuses round 0's run at width 1
    results["memory"] = {"width": width, "ddp_state_bytes": ddp_state, "target": 1.02, "fsdp": {}}
    for ranks in ranks_for_memory:
        per_rank = [
            r["state_bytes"] for r in bench.train("train_fsdp.py", ranks, *memory_steps)["ranks"]
        ]
        results["memory"]["fsdp"][str(ranks)] = {
            "max_state_bytes": max(per_rank),
            "ratio_to_ddp_over_n": max(per_rank) / (ddp_state / ranks),
        }
    results["memory"]["tp"] = {}
    for ranks in [
        r for r in ranks_for_memory if r > 1 and 8 * width % r == 0
    ]:  # TP over all of them: dp 1
        per_rank = [
            r["state_bytes"]
            for r in bench.train("train_tp.py", ranks, "--tp", ranks, *memory_steps)["ranks"]
        ]
        results["memory"]["tp"][str(ranks)] = {
            "max_state_bytes": max(per_rank),
            "ratio_to_ddp_over_n": max(per_rank) / (ddp_state / ranks),
        }

    # 5. Pipeline: measured step time against (m + p - 1) x the slowest stage's time per microbatch.
    p = 2
    results["pipeline"] = {"stages": p, "rows": []}
    for m in microbatches:
        stage_times = bench.helper(
            "stage_time.py", "--stages", p, "--microbatch", args.batch_size // m
        )
        slowest = max(stage_times["seconds_per_microbatch"])
        for schedule in ("gpipe", "1f1b"):
            metrics = bench.train(
                "train_pippy.py", p, "--schedule", schedule, "--microbatches", m, *batch
            )
            measured = metrics["train_seconds"] / metrics["steps"]
            ideal = (m + p - 1) * slowest
            results["pipeline"]["rows"].append(
                {
                    "schedule": schedule,
                    "microbatches": m,
                    "measured_step_seconds": measured,
                    "ideal_step_seconds": ideal,
                    "ratio": measured / ideal,
                    "bubble_fraction": (p - 1) / (m + p - 1),
                    "loss_curve": metrics["loss_curve"],
                }
            )
    results["loss_curves"] = {
        **curves,
        "pipeline 1f1b (2 stages)": results["pipeline"]["rows"][-1]["loss_curve"],
    }

    return results


def gpu_figures(bench, steps, ranks):
    """6. On GPUs: the bare loop, train_ddp.py in fp32, bf16 and compiled at batch 64 and 512 on one
    GPU, and FSDP and the pipeline on ``ranks`` GPUs; steady-state samples/s and peak memory."""
    on_gpu = ["--device", "cuda", "--max-steps", steps, "--epochs", 1000]
    rows, bare = [], {}
    for batch in (64, 512):
        bare[batch] = bench.helper(
            "bare_loop.py", "--device", "cuda", "--steps", steps, "--batch-size", batch
        )["samples_per_second"]
        rows.append(
            {
                "run": "bare loop (fp32)",
                "ranks": 1,
                "batch_size": batch,
                "samples_per_second": bare[batch],
                "steady_samples_per_second": bare[batch],
                "peak_memory_bytes": None,
            }
        )
        for label, flags in (
            ("fp32", []),
            ("bf16", ["--precision", "bf16"]),
            ("fp32, --compile", ["--compile"]),
        ):
            metrics = bench.train("train_ddp.py", 1, *on_gpu, "--batch-size", batch, *flags)
            rows.append(_gpu_row(f"train_ddp.py ({label})", 1, batch, metrics))
    for script in ("train_fsdp.py", "train_pippy.py", "train_tp.py"):
        rows.append(
            _gpu_row(
                f"{script} (fp32)",
                ranks,
                64,
                bench.train(script, ranks, *on_gpu, "--batch-size", 64),
            )
        )
    eager = {
        row["batch_size"]: row["steady_samples_per_second"]
        for row in rows
        if row["run"] == "train_ddp.py (fp32)"
    }
    for row in rows:
        row["vs_bare_loop"] = (
            row["steady_samples_per_second"] / bare[row["batch_size"]]
            if row["steady_samples_per_second"]
            else None
        )
        # targets: eager train_ddp.py >= 0.95 x the bare loop; --compile (CUDA graphs) >= 1.6 x
        # eager at batch 512
        row["vs_eager_train_ddp"] = (
            row["steady_samples_per_second"] / eager[row["batch_size"]]
            if row["run"].startswith("train_ddp.py")
            and row["steady_samples_per_second"]
            and eager.get(row["batch_size"])
            else None
        )
    return {
        "name": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "steps": steps,
        "rows": rows,
    }


def steady_state(metrics, log_every=20):
    """(first step, samples/s) of a run's steady state, from its metrics' loss curve of [step, loss,
    training seconds]: from the first curve point at least max(log_every, steps // 10) steps past
    the start, to the end of training (the first steps pay for lazy initialisation, cuDNN's
    algorithm search, the allocator's growth). ``log_every`` is the run's --log-every (the scripts'
    default here). (None, None) for a run too short to have one. The runs here start at step 0 (none
    resumes from a checkpoint)."""
    end = metrics["steps"]
    point = next((p for p in metrics["loss_curve"] if p[0] >= max(log_every, end // 10)), None)
    if point is None or point[0] == end:
        return None, None
    step, _, seconds = point
    return step, (end - step) * metrics["global_batch_size"] / max(
        metrics["train_seconds"] - seconds, 1e-9
    )


def _gpu_row(run, ranks, batch, metrics):
    return {
        "run": run,
        "ranks": ranks,
        "batch_size": batch,
        "samples_per_second": metrics["samples_per_second"],
        "steady_samples_per_second": steady_state(metrics)[1],
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in metrics["ranks"]),
    }


def machine():
    import platform

    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.processor()
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def markdown(r):
    m = r["machine"]
    lines = (
        cpu_table(r)
        if "overhead" in r
        else [f"Machine: {m['cpu']}, {m['cores']} cores, {m['gpus']} GPUs, torch {m['torch']}."]
    )
    if "gpu" in r:
        g = r["gpu"]
        lines += [
            "",
            f"Measured on a GPU: {g['gpus']} × {g['name']}; {g['steps']} steps per run, synthetic "
            "data, "
            "steady state from the first logging point past a tenth of the run.",
            "",
            "| 6. run | GPUs | batch per rank | samples/s, whole run | samples/s, steady state | "
            "vs bare loop | vs eager train_ddp.py | peak memory per rank |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for row in g["rows"]:
            vs = f"{row['vs_bare_loop']:.2f}" if row["vs_bare_loop"] else ""
            vs_eager = f"{row['vs_eager_train_ddp']:.2f}×" if row.get("vs_eager_train_ddp") else ""
            memory = (
                f"{row['peak_memory_bytes'] / 2**20:,.0f} MiB" if row["peak_memory_bytes"] else ""
            )
            steady = (
                f"{row['steady_samples_per_second']:,.0f}"
                if row["steady_samples_per_second"]
                else ""
            )
            lines.append(
                f"| {row['run']} | {row['ranks']} | {row['batch_size']} | "
                f"{row['samples_per_second']:,.0f} | {steady} | {vs} | {vs_eager} | {memory} |"
            )
    return "\n".join(lines) + "\n"


def cpu_table(r):
    """Figures 1 to 5: the machine's line, then a row per figure."""
    o, d, s, mem = r["overhead"], r["data_path"], r["scaling"], r["memory"]
    t = s["ddp_step"]

    def spread(figure, spec):  # the lowest and highest ratio over the rounds
        return (
            f" ({figure['ratio_min']:{spec}}–{figure['ratio_max']:{spec}})"
            if r["repeats"] > 1
            else ""
        )

    rounds = (
        f"; figures 1 and 3 are medians of {r['repeats']} rounds (ratio range in brackets)"
        if r["repeats"] > 1
        else ""
    )
    lines = [
        f"Machine: {r['machine']['cpu']}, {r['machine']['cores']} cores, {r['machine']['gpus']} "
        f"GPUs, torch {r['machine']['torch']}; "
        f"{r['steps']} steps at batch {r['batch_size']} per rank, 1 thread per process, synthetic "
        f"data{rounds}.",
        "",
        "| figure | measured | reference | ratio | target |",
        "| --- | --- | --- | --- | --- |",
        f"| 1. overhead: train_ddp.py, 1 process | {o['ddp_1']:,.0f} samples/s | bare loop "
        f"{o['bare_loop']:,.0f} samples/s | {o['ratio']:.3f}{spread(o, '.3f')} | ≥ {o['target']} |",
        f"| 2. data path: on-device gather | {d['device_loader_samples_per_second']:,.0f} "
        f"samples/s | DataLoader + ToTensor/Normalize {d['dataloader_samples_per_second']:,.0f} "
        f"samples/s | {d['ratio']:,.0f}× | |",
        f"| 3. scaling: DDP, 2 processes | {s['ddp']['ddp_2']:,.0f} samples/s | 1 process "
        f"{s['ddp']['ddp_1']:,.0f} samples/s | {s['ddp']['ratio']:.2f}×{spread(s['ddp'], '.2f')} | "
        f"≥ {s['target_ddp']}× |",
        f"| 3. scaling: FSDP, 2 processes | {s['fsdp']['fsdp_2']:,.0f} samples/s | 1 process "
        f"{s['fsdp']['fsdp_1']:,.0f} samples/s | "
        f"{s['fsdp']['ratio']:.2f}×{spread(s['fsdp'], '.2f')} | |",
        "| 3. scaling: TP, 2 processes (tp 2: one batch, each layer split) | "
        f"{s['tp']['tp_2']:,.0f} samples/s | DDP, 1 process {s['tp']['ddp_1']:,.0f} samples/s | "
        f"{s['tp']['ratio']:.2f}×{spread(s['tp'], '.2f')} | |",
        f"| 3. DDP step on 2 processes, per rank | compute {t['compute_ms']:.1f} ms + waiting for "
        f"the slower rank {t['wait_ms']:.1f} ms "
        f"+ all-reduce once both are ready {t['allreduce_ms']:.1f} ms | the same all-reduce "
        f"between idle ranks {t['idle_allreduce_ms']:.2f} ms "
        f"(1 float: {t['idle_allreduce_one_float_ms']:.2f} ms) | | |",
        "| 3. ceiling: 2 bare loops at once, no communication | "
        f"{s['ceiling']['two_bare_loops']:,.0f} samples/s | 1 bare loop "
        f"{s['ceiling']['bare_loop']:,.0f} samples/s | "
        f"{s['ceiling']['ratio']:.2f}×{spread(s['ceiling'], '.2f')} | |",
    ]
    for ranks, row in mem["fsdp"].items():
        lines.append(
            f"| 4. memory: FSDP, {ranks} rank(s), width {mem['width']} | "
            f"{row['max_state_bytes']:,} bytes (largest rank) | "
            f"DDP / {ranks} = {mem['ddp_state_bytes'] / int(ranks):,.0f} bytes | "
            f"{row['ratio_to_ddp_over_n']:.4f} | ≤ {mem['target']} |"
        )
    for ranks, row in mem.get("tp", {}).items():
        lines.append(
            f"| 4. memory: TP, {ranks} rank(s), width {mem['width']} | {row['max_state_bytes']:,} "
            "bytes (largest rank) | "
            f"DDP / {ranks} = {mem['ddp_state_bytes'] / int(ranks):,.0f} bytes | "
            f"{row['ratio_to_ddp_over_n']:.4f} | |"
        )
    for row in r["pipeline"]["rows"]:
        lines.append(
            f"| 5. pipeline: {row['schedule']}, p = {r['pipeline']['stages']}, m = "
            f"{row['microbatches']} | "
            f"{row['measured_step_seconds'] * 1000:.1f} ms/step | ideal (m+p−1)·t_stage "
            f"{row['ideal_step_seconds'] * 1000:.1f} ms "
            f"(bubble {row['bubble_fraction']:.0%}) | {row['ratio']:.2f} | |"
        )
    return lines


def plot(r, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, speed, memory) = plt.subplots(1, 3, figsize=(15, 4.2))
    for label, curve in r["loss_curves"].items():
        curves.plot(
            [s for s, _, _ in curve], [loss for _, loss, _ in curve], marker=".", label=label
        )
    curves.set(
        title="training loss (logged, all ranks / last stage)",
        xlabel="optimizer step",
        ylabel="loss",
        yscale="log",
    )
    curves.legend()
    for strategy, one, two, label in (
        ("ddp", "ddp_1", "ddp_2", "DDP"),
        ("fsdp", "fsdp_1", "fsdp_2", "FSDP"),
        ("ceiling", "bare_loop", "two_bare_loops", "bare loops, no communication"),
    ):
        speed.plot(
            [1, 2],
            [r["scaling"][strategy][one], r["scaling"][strategy][two]],
            marker="o",
            label=label,
        )
    speed.set(
        title="throughput by world size (medians)",
        xlabel="processes",
        ylabel="samples/s",
        xticks=[1, 2],
    )
    speed.legend()
    ranks = [int(n) for n in r["memory"]["fsdp"]]
    memory.plot(
        ranks,
        [r["memory"]["ddp_state_bytes"] / 2**20] * len(ranks),
        marker="o",
        label="DDP (every rank)",
    )
    memory.plot(
        ranks,
        [r["memory"]["fsdp"][str(n)]["max_state_bytes"] / 2**20 for n in ranks],
        marker="o",
        label="FSDP (largest rank)",
    )
    memory.set(
        title=f"per-rank training state, width {r['memory']['width']}",
        xlabel="ranks",
        ylabel="MiB",
        xticks=ranks,
    )
    memory.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    start = time.monotonic()
    main()
    print(f"benchmark: {time.monotonic() - start:.0f} s")
