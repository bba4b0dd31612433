"""Training seconds to 98% and 99% test accuracy on the real MNIST, per script, as a user runs it.

    python docs/time_to_accuracy.py  # the three default commands, then --epochs 4
    python docs/time_to_accuracy.py --epochs 2      # the default commands only
    python docs/time_to_accuracy.py --epochs 1 -- --data-dir DIR  # flags after -- go to each script

Each script runs under torchrun on --ranks processes (2: what `bash run_*.sh` starts without GPUs;
on a GPU node, one per GPU) with its defaults and the bundled MNIST (`--dataset auto`), evaluating
after every epoch. The seconds are training seconds (evaluations excluded), read from the run's own
metrics; the accuracy is the test set's after each epoch. Writes time_to_accuracy.json and .md to
--out.
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from compare import launch, machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("train_ddp.py", "train_fsdp.py", "train_pippy.py")
EPOCH = re.compile(r"^epoch (\d+): step (\d+), .* test accuracy ([\d.]+)%$", re.M)


def run(script, ranks, epochs, scratch, flags=()):
    """[(epoch, step, training seconds, test accuracy %)] of one run, and its metrics."""
    metrics_path = scratch / f"{script}-{epochs}.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        ROOT / script,
        "--metrics",
        metrics_path,
        *(["--epochs", str(epochs)] if epochs else []),
        *flags,
    ]
    (output,) = launch(command, timeout=3600)
    metrics = json.loads(metrics_path.read_text())
    seconds = {
        step: s for step, _, s in metrics["loss_curve"]
    }  # every epoch ends at a logging step
    return [
        (int(e), int(step), seconds[int(step)], float(a)) for e, step, a in EPOCH.findall(output)
    ], metrics


def first_to(epochs, target):
    return next((seconds for _, _, seconds, accuracy in epochs if accuracy >= target), None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=torch.cuda.device_count() or 2)
    parser.add_argument(
        "--epochs", type=int, nargs="*", default=[0, 4], help="0: the scripts' default"
    )
    parser.add_argument("--out", default=ROOT / "docs" / "results")
    parser.add_argument("flags", nargs="*", help="more flags for each script, after --")
    args = parser.parse_args()
    out, scratch, rows = Path(args.out), Path(tempfile.mkdtemp(prefix="time-to-accuracy-")), []
    for epochs in args.epochs:
        for script in SCRIPTS:
            print(f"{script}, {epochs or 'default'} epochs, {args.ranks} ranks", flush=True)
            per_epoch, metrics = run(script, args.ranks, epochs, scratch, args.flags)
            rows.append(
                {
                    "script": script,
                    "epochs": len(per_epoch),
                    "ranks": args.ranks,
                    "global_batch_size": metrics["global_batch_size"],
                    "peak_lr": metrics["peak_lr"],
                    "per_epoch": per_epoch,
                    "seconds_to_98": first_to(per_epoch, 98.0),
                    "seconds_to_99": first_to(per_epoch, 99.0),
                    "final_accuracy": per_epoch[-1][3],
                }
            )
    subprocess.run(["rm", "-rf", str(scratch)], check=False)
    report = {"machine": machine(), "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "time_to_accuracy.json").write_text(json.dumps(report, indent=2) + "\n")
    m = report["machine"]
    lines = [
        f"Measured on {m['cpu']} ({m['cores']} cores, {m['gpus']} GPUs), torch {m['torch']}.",
        "",
        "| script | epochs | ranks | global batch | peak lr | accuracy after each epoch | to 98 % "
        "| to 99 % |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        after = " / ".join(f"{a:.2f}" for *_, a in r["per_epoch"])
        to = [
            f"{r[k]:.1f} s" if r[k] is not None else "not reached"
            for k in ("seconds_to_98", "seconds_to_99")
        ]
        lines.append(
            f"| {r['script']} | {r['epochs']} | {r['ranks']} | {r['global_batch_size']} | "
            f"{r['peak_lr']:g} | "
            f"{after} % | {to[0]} | {to[1]} |"
        )
    (out / "time_to_accuracy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
