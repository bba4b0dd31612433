"""Plot a run's --log-dir metrics.csv: the training loss (all ranks) at each logging step, the test
loss and accuracy at each evaluation, and the lr. Works while the run trains (the rows are flushed
as written).

    bash run_ddp.sh --log-dir logs/ddp
    python benchmarks/plot_log.py logs/ddp docs/images/log_ddp.png
"""

import argparse
import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("log_dir", type=Path)
parser.add_argument("out", type=Path)
args = parser.parse_args()

with open(args.log_dir / "metrics.csv", newline="") as file:
    rows = list(csv.DictReader(file))
train = [(int(r["step"]), float(r["train_loss"]), float(r["lr"])) for r in rows if r["train_loss"]]
test = [
    (int(r["step"]), float(r["test_loss"]), float(r["test_accuracy"]))
    for r in rows
    if r["test_loss"]
]

figure, (loss_axes, lr_axes) = plt.subplots(2, 1, figsize=(7, 5), sharex=True, height_ratios=[3, 1])
loss_axes.plot([s for s, _, _ in train], [v for _, v, _ in train], label="train loss (all ranks)")
accuracies = ", ".join(f"{accuracy:.2%}" for _, _, accuracy in test)
loss_axes.plot(
    [s for s, _, _ in test],
    [v for _, v, _ in test],
    "o-",
    label=f"test loss (accuracy {accuracies})",
)
loss_axes.set_yscale("log")
loss_axes.set_ylabel("cross-entropy")
loss_axes.legend(loc="upper right")
lr_axes.plot([s for s, _, _ in train], [v for _, _, v in train], color="grey")
lr_axes.set_ylabel("lr")
lr_axes.set_xlabel("optimizer step")
figure.suptitle(f"{args.log_dir}/metrics.csv")
figure.tight_layout()
figure.savefig(args.out, dpi=100)
print(f"wrote {args.out}")
