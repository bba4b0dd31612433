"""The linear scaling rule and warmup, measured: train_ddp.py, batch 64 and 512, SGD with momentum.

    python docs/lr_scaling.py  # 4 runs of 3 epochs, 2 at a time: about 3 minutes on 2 cores
    python docs/lr_scaling.py --epochs 1      # the same runs, one epoch each
    # flags after -- go to every run: the smoke test's small MNIST, no warmup, a log line a step
    python docs/lr_scaling.py --epochs 1 -- --dataset mnist --data-dir D --warmup-steps 0 \
        --log-every 1

Runs the real script, one process each, on the synthetic set with the same seed:

    base      batch 64,  lr 0.005                       (the lr tuned for batch 64)
    unscaled  batch 512, lr 0.005                       (8x fewer steps per epoch, same lr)
    scaled    batch 512, --scale-lr: lr 0.04, no warmup (the linear scaling rule alone)
    warmup    batch 512, --scale-lr, --warmup-steps 50  (the rule with Goyal et al.'s warmup)

One process at batch 512 takes the same optimizer steps as 8 DDP ranks at batch 64 (DDP averages the
ranks' gradients, so the step's gradient is the mean over the same 512 samples; tests/test_ddp.py
checks that equivalence), so one process stands in for 8 ranks here. Records the test accuracy after
each epoch (from the scripts' "epoch N: ... test accuracy X%" lines) and the training loss every
2,560 samples (--log-every 40 at batch 64, 5 at batch 512, so the curves share their x-axis: samples
seen). Prints a Markdown table and writes lr_scaling.json and lr_scaling.png to --out.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from compare import machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BASE_LR = 0.005  # SGD, momentum 0.9, at batch 64: lr 0.005 to 0.03 all learn there, 0.05 does not
# Batch 512 trains from the first step at lr 0.02 but not at 0.04 (tried by hand): a ramp of 50
# steps stays below 0.02 for its first 25 (half an epoch's samples at batch 64 lie behind it), and
# is a seventh of a 3-epoch run (Goyal et al.: 5 epochs of 90).
WARMUP_STEPS = 50
SAMPLES_PER_LOG = 2560  # 40 steps at batch 64, 5 at batch 512
RUNS = {  # name: (global batch, extra flags)
    "base": (64, []),
    "unscaled": (512, []),
    "scaled": (512, ["--scale-lr"]),
    "warmup": (512, ["--scale-lr", "--warmup-steps", str(WARMUP_STEPS)]),
}
EPOCH_LINE = re.compile(r"epoch (\d+): step (\d+), .*test accuracy ([\d.]+)%")


def start(name, batch, flags, epochs, scratch, more=()):
    metrics = scratch / f"{name}.json"
    command = [
        sys.executable,
        str(ROOT / "train_ddp.py"),
        "--dataset",
        "synthetic",
        "--seed",
        "0",
        "--optimizer",
        "sgd",
        "--lr",
        str(BASE_LR),
        "--base-batch-size",
        "64",
        "--batch-size",
        str(batch),
        "--epochs",
        str(epochs),
        "--log-every",
        str(SAMPLES_PER_LOG // batch),
        "--metrics",
        str(metrics),
        "--lr-schedule",
        "constant",
        "--warmup-steps",
        "0",
        *flags,
        *more,
    ]  # the rule as Goyal et al. state it: a constant lr, warmup where said
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("RANK", None)
    print(f"start {name}: {' '.join(command[1:])}", flush=True)
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return process, metrics


def finish(name, batch, process, metrics):
    output, _ = process.communicate()
    epochs = [
        {"epoch": int(e), "step": int(s), "test_accuracy": float(a) / 100}
        for e, s, a in EPOCH_LINE.findall(output)
    ]
    error = next((line for line in output.splitlines() if line.startswith("error:")), None)
    if process.returncode != 0 and not (error and "diverged" in error):
        sys.exit(f"lr_scaling: {name} failed (exit code {process.returncode}):\n{output[-3000:]}")
    result = {"global_batch_size": batch, "epochs": epochs, "error": error}
    if metrics.exists():  # not written by a run that stopped on a non-finite loss
        m = json.loads(metrics.read_text())
        result.update(
            lr=m["peak_lr"],
            steps=m["steps"],
            samples_per_second=m["samples_per_second"],
            loss_curve=[[step * batch, loss] for step, loss, _ in m["loss_curve"]],
        )
    print(
        f"done {name}: "
        + (", ".join(f"epoch {e['epoch']} {e['test_accuracy']:.2%}" for e in epochs) or error),
        flush=True,
    )
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--jobs", type=int, default=2, help="runs at a time (each is one process, one thread)"
    )
    parser.add_argument("--out", default=str(ROOT / "docs" / "images"))
    parser.add_argument("flags", nargs="*", help="more flags for every run, after --")
    args = parser.parse_args()
    out, scratch = Path(args.out), Path(tempfile.mkdtemp(prefix="lr-scaling-"))
    out.mkdir(parents=True, exist_ok=True)
    results, waiting, running = {}, list(RUNS), []
    while waiting or running:
        while waiting and len(running) < args.jobs:
            name = waiting.pop(0)
            running.append((name, *start(name, *RUNS[name], args.epochs, scratch, args.flags)))
        name, process, metrics = running.pop(0)
        results[name] = finish(name, RUNS[name][0], process, metrics)
    report = {
        "machine": machine(),
        "epochs": args.epochs,
        "base_lr": BASE_LR,
        "warmup_steps": WARMUP_STEPS,
        "optimizer": "sgd, momentum 0.9, weight decay 5e-4",
        "runs": {n: results[n] for n in RUNS},
    }
    (out / "lr_scaling.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out / "lr_scaling.png")
    print(markdown(report))
    print(f"wrote {out / 'lr_scaling.json'} and {out / 'lr_scaling.png'}")


def markdown(report):
    """The table: test accuracy after each epoch; samples seen until the logged training loss first
    fell below 0.1; the mean of the logged losses over the last epoch."""
    epochs = report["epochs"]
    lines = [
        "| run | global batch | lr | warmup | "
        + " | ".join(f"epoch {e}" for e in range(1, epochs + 1))
        + " | loss below 0.1 after | loss over the last epoch |",
        "| --- | --- | --- | --- |" + " --- |" * (epochs + 2),
    ]
    for name, r in report["runs"].items():
        warmup = f"{report['warmup_steps']} steps" if name == "warmup" else "none"
        lr = f"{r['lr']:g}" if "lr" in r else "?"
        accuracy = [f"{e['test_accuracy']:.2%}" for e in r["epochs"]]
        accuracy += ["stopped: loss not finite"] * (epochs - len(accuracy)) if r["error"] else []
        curve = r.get("loss_curve", [])
        below = next((samples for samples, loss in curve if loss < 0.1), None)
        start = r["epochs"][-2]["step"] * r["global_batch_size"] if len(r["epochs"]) > 1 else 0
        last = [loss for samples, loss in curve if samples > start]
        tail = (
            f"{below:,} samples" if below else "never",
            f"{sum(last) / len(last):.1e}" if last else "",
        )
        lines.append(
            f"| {name} | {r['global_batch_size']} | {lr} | {warmup} | "
            + " | ".join([*accuracy, *tail])
            + " |"
        )
    return "\n".join(lines)


def plot(report, path):
    """Left: the training loss by samples seen. Right: the test error (1 - accuracy) after each
    epoch, on a log axis, where 99.6% and 99.98% differ by 20x rather than by a pixel. One legend,
    under both panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # % of the 10,000 test images: half an image; a run with no error is drawn on this line
    floor = 0.005
    fig, (loss, error) = plt.subplots(1, 2, figsize=(11, 4.6))
    for name, r in report["runs"].items():
        label = f"{name}: batch {r['global_batch_size']}, lr {r.get('lr', 0):g}"
        label += f", {report['warmup_steps']} warmup steps" if name == "warmup" else ""
        if r.get("loss_curve"):
            loss.plot([s for s, _ in r["loss_curve"]], [v for _, v in r["loss_curve"]], label=label)
        else:
            loss.plot([], [], label=label)  # keeps the colours of the two panels in step
        if r["epochs"]:
            error.plot(
                [e["epoch"] for e in r["epochs"]],
                [max(100 * (1 - e["test_accuracy"]), floor) for e in r["epochs"]],
                marker="o",
            )
    loss.set(
        title="training loss (mean over 2,560 samples)",
        xlabel="samples seen",
        ylabel="loss",
        yscale="log",
    )
    error.axhline(floor, color="grey", linewidth=0.8, linestyle=":")
    error.text(
        1.05, floor * 1.15, "no test error", ha="left", va="bottom", fontsize=8, color="grey"
    )
    error.set(
        title="test error (100% - accuracy) after each epoch",
        xlabel="epoch",
        ylabel="% of test images",
        yscale="log",
        xticks=range(1, report["epochs"] + 1),
        ylim=(floor / 1.6, 150),
    )
    error.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    handles, labels = loss.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    began = time.monotonic()
    main()
    print(f"lr_scaling: {time.monotonic() - began:.0f} s")
