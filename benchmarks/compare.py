"""Measure the strategies side by side with the project's own scripts, in one run.

    python benchmarks/compare.py                      # a few minutes on a 2-core CPU machine
    python benchmarks/compare.py --quick              # the smallest size (the smoke test's)
    python benchmarks/compare.py --steps 2000 --width 32 --max-ranks 8   # on a GPU node

Every configuration runs the real script under torchrun (or plain python for the one-process
baseline) with one thread per process, on the synthetic set, with the same seed. Prints a Markdown
table and writes results.json, results.md and results.png to --out.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def launch(command, timeout):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("RANK", None)
    result = subprocess.run([str(c) for c in command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        sys.exit(f"benchmark: {' '.join(map(str, command))} failed:\n{result.stderr[-2000:]}")
    return result.stdout


class Bench:
    def __init__(self, args):
        self.args, self.scratch = args, Path(tempfile.mkdtemp(prefix="bench-"))
        self.done, self.total, self.cache = 0, 0, {}

    def progress(self, what):
        self.done += 1
        print(f"[{self.done}/{self.total}] {what}", flush=True)

    def train(self, script, ranks, *flags):
        """Run a training script under torchrun (once per configuration); return its metrics."""
        key = (script, ranks, *map(str, flags))
        if key not in self.cache:
            metrics = self.scratch / f"m{self.done}.json"
            common = ["--dataset", "synthetic", "--seed", "0", "--no-eval", "--metrics", metrics]
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", ROOT / script]
            self.progress(f"{script} on {ranks} process(es) {' '.join(map(str, flags))}")
            launch(command + common + [str(f) for f in flags], self.args.timeout)
            self.cache[key] = json.loads(metrics.read_text())
        return self.cache[key]

    def helper(self, name, *flags):
        self.progress(f"benchmarks/{name} {' '.join(map(str, flags))}")
        return json.loads(launch([sys.executable, ROOT / "benchmarks" / name, *flags], self.args.timeout).strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smallest size: fewer steps, narrower model, fewer configurations")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per training run (default 300, quick 20)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=None, help="BabyCNN width for the memory figure (default 8, quick 1)")
    parser.add_argument("--max-ranks", type=int, default=None, help="largest world size for the memory figure (default 4, quick 2)")
    parser.add_argument("--microbatches", default=None, help="comma-separated microbatch counts (default 2,4,8,16; quick 4)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds one configuration may take")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    steps = args.steps or (20 if args.quick else 300)
    width = args.width or (1 if args.quick else 8)
    microbatches = [int(m) for m in (args.microbatches or ("4" if args.quick else "2,4,8,16")).split(",")]
    ranks_for_memory = [n for n in (1, 2, 4, 8) if n <= (args.max_ranks or (2 if args.quick else 4))]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench = Bench(args)
    # Configurations to run (identical ones run once: at width 1 the memory runs are the scaling runs).
    bench.total = 6 + (1 + len(ranks_for_memory) if width > 1 else sum(n > 2 for n in ranks_for_memory)) + 3 * len(microbatches)
    batch = ["--batch-size", args.batch_size, "--max-steps", steps, "--epochs", 1000]
    results = {"machine": machine(), "steps": steps, "batch_size": args.batch_size}

    # 1. Overhead: the script on one process against the bare loop over the same model.
    ddp_one = bench.train("train_ddp.py", 1, *batch)
    bare = bench.helper("bare_loop.py", "--steps", steps, "--batch-size", args.batch_size)
    results["overhead"] = {"script": ddp_one["samples_per_second"], "bare_loop": bare["samples_per_second"],
                           "ratio": ddp_one["samples_per_second"] / bare["samples_per_second"], "target": 0.95}

    # 2. Data path: on-device gather against torchvision Dataset + DataLoader + transforms.
    loaders = bench.helper("data_path.py", "--batches", max(steps, 50), "--batch-size", args.batch_size)
    results["data_path"] = {**loaders, "ratio": loaders["device_loader_samples_per_second"] / loaders["dataloader_samples_per_second"]}

    # 3. Scaling: 2 processes against 1 (same per-rank batch), DDP and FSDP.
    runs = {}
    for strategy, script in (("ddp", "train_ddp.py"), ("fsdp", "train_fsdp.py")):
        for ranks in (1, 2):
            runs[strategy, ranks] = bench.train(script, ranks, *batch)
    results["scaling"] = {
        strategy: {"1": runs[strategy, 1]["samples_per_second"], "2": runs[strategy, 2]["samples_per_second"],
                   "speedup": runs[strategy, 2]["samples_per_second"] / runs[strategy, 1]["samples_per_second"]}
        for strategy in ("ddp", "fsdp")
    }
    results["scaling"]["target_ddp"] = 1.8

    # 4. Memory: per-rank training state of a wide model, FSDP on N ranks against DDP.
    memory_steps = batch if width == 1 else ["--batch-size", 8, "--max-steps", 2, "--epochs", 1, "--width", width]
    ddp_state = bench.train("train_ddp.py", 1, *memory_steps)["ranks"][0]["state_bytes"]
    results["memory"] = {"width": width, "ddp_state_bytes": ddp_state, "target": 1.02, "fsdp": {}}
    for ranks in ranks_for_memory:
        per_rank = [r["state_bytes"] for r in bench.train("train_fsdp.py", ranks, *memory_steps)["ranks"]]
        results["memory"]["fsdp"][str(ranks)] = {"max_state_bytes": max(per_rank), "ratio_to_ddp_over_n": max(per_rank) / (ddp_state / ranks)}

    # 5. Pipeline: measured step time against (m + p - 1) x the slowest stage's time per microbatch.
    p = 2
    results["pipeline"] = {"stages": p, "rows": []}
    for m in microbatches:
        stage_times = bench.helper("stage_time.py", "--stages", p, "--microbatch", args.batch_size // m)
        slowest = max(stage_times["seconds_per_microbatch"])
        for schedule in ("gpipe", "1f1b"):
            metrics = bench.train("train_pippy.py", p, "--schedule", schedule, "--microbatches", m, *batch)
            measured = metrics["train_seconds"] / metrics["steps"]
            ideal = (m + p - 1) * slowest
            results["pipeline"]["rows"].append({
                "schedule": schedule, "microbatches": m, "measured_step_seconds": measured, "ideal_step_seconds": ideal,
                "ratio": measured / ideal, "bubble_fraction": (p - 1) / (m + p - 1), "loss_curve": metrics["loss_curve"],
            })
    results["loss_curves"] = {"ddp (2 ranks)": runs["ddp", 2]["loss_curve"], "fsdp (2 ranks)": runs["fsdp", 2]["loss_curve"],
                              "pipeline 1f1b (2 stages)": results["pipeline"]["rows"][-1]["loss_curve"]}

    ratios = [results["overhead"]["ratio"], results["data_path"]["ratio"], *(results["scaling"][k]["speedup"] for k in ("ddp", "fsdp")),
              *(row["ratio_to_ddp_over_n"] for row in results["memory"]["fsdp"].values()), *(row["ratio"] for row in results["pipeline"]["rows"])]
    if not all(math.isfinite(v) and v > 0 for v in ratios):  # before anything is written
        sys.exit(f"benchmark: a figure is not a positive finite number: {ratios}")
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    (out / "results.md").write_text(table)
    plot(results, out / "results.png")
    print(table)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'results.png'}")


def machine():
    import platform

    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    return {"cpu": cpu, "cores": os.cpu_count(), "gpus": torch.cuda.device_count(), "torch": torch.__version__, "python": platform.python_version()}


def markdown(r):
    o, d, s, mem = r["overhead"], r["data_path"], r["scaling"], r["memory"]
    lines = [
        f"Machine: {r['machine']['cpu']}, {r['machine']['cores']} cores, {r['machine']['gpus']} GPUs, torch {r['machine']['torch']}; "
        f"{r['steps']} steps at batch {r['batch_size']} per rank, 1 thread per process, synthetic data.",
        "",
        "| figure | measured | reference | ratio | target |",
        "| --- | --- | --- | --- | --- |",
        f"| 1. overhead: train_ddp.py, 1 process | {o['script']:,.0f} samples/s | bare loop {o['bare_loop']:,.0f} samples/s | {o['ratio']:.3f} | ≥ {o['target']} |",
        f"| 2. data path: on-device gather | {d['device_loader_samples_per_second']:,.0f} samples/s | DataLoader + ToTensor/Normalize {d['dataloader_samples_per_second']:,.0f} samples/s | {d['ratio']:,.0f}× | |",
        f"| 3. scaling: DDP, 2 processes | {s['ddp']['2']:,.0f} samples/s | 1 process {s['ddp']['1']:,.0f} samples/s | {s['ddp']['speedup']:.2f}× | ≥ {s['target_ddp']}× |",
        f"| 3. scaling: FSDP, 2 processes | {s['fsdp']['2']:,.0f} samples/s | 1 process {s['fsdp']['1']:,.0f} samples/s | {s['fsdp']['speedup']:.2f}× | |",
    ]
    for ranks, row in mem["fsdp"].items():
        lines.append(f"| 4. memory: FSDP, {ranks} rank(s), width {mem['width']} | {row['max_state_bytes']:,} bytes (largest rank) | "
                     f"DDP / {ranks} = {mem['ddp_state_bytes'] / int(ranks):,.0f} bytes | {row['ratio_to_ddp_over_n']:.4f} | ≤ {mem['target']} |")
    for row in r["pipeline"]["rows"]:
        lines.append(f"| 5. pipeline: {row['schedule']}, p = {r['pipeline']['stages']}, m = {row['microbatches']} | "
                     f"{row['measured_step_seconds'] * 1000:.1f} ms/step | ideal (m+p−1)·t_stage {row['ideal_step_seconds'] * 1000:.1f} ms "
                     f"(bubble {row['bubble_fraction']:.0%}) | {row['ratio']:.2f} | |")
    return "\n".join(lines) + "\n"


def plot(r, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, speed, memory) = plt.subplots(1, 3, figsize=(15, 4.2))
    for label, curve in r["loss_curves"].items():
        curves.plot([s for s, _ in curve], [loss for _, loss in curve], marker=".", label=label)
    curves.set(title="training loss (logged, all ranks / last stage)", xlabel="optimizer step", ylabel="loss", yscale="log")
    curves.legend()
    for strategy in ("ddp", "fsdp"):
        speed.plot([1, 2], [r["scaling"][strategy]["1"], r["scaling"][strategy]["2"]], marker="o", label=strategy.upper())
    speed.set(title="throughput by world size", xlabel="processes", ylabel="samples/s", xticks=[1, 2])
    speed.legend()
    ranks = [int(n) for n in r["memory"]["fsdp"]]
    memory.plot(ranks, [r["memory"]["ddp_state_bytes"] / 2**20] * len(ranks), marker="o", label="DDP (every rank)")
    memory.plot(ranks, [r["memory"]["fsdp"][str(n)]["max_state_bytes"] / 2**20 for n in ranks], marker="o", label="FSDP (largest rank)")
    memory.set(title=f"per-rank training state, width {r['memory']['width']}", xlabel="ranks", ylabel="MiB", xticks=ranks)
    memory.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    start = time.monotonic()
    main()
    print(f"benchmark: {time.monotonic() - start:.0f} s")
