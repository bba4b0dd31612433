"""--log-dir DIR: rank 0's row per logging step in metrics.csv, and TensorBoard's events if
installed (opt-in: imported only when the flag is given, so a copy without this file refuses the
flag in one line)."""

import csv
import io
import os

from plumbing.outputs import write_atomically


class MetricsLog:
    """metrics.csv and, if installed, TensorBoard's events. A resumed run keeps the rows to its
    checkpoint: no step twice, none missing."""

    FIELDS = ["step", "epoch", "train_loss", "lr", "grad_norm", "samples_per_second"]
    FIELDS += ["test_loss", "test_accuracy"]

    def __init__(self, directory, start_step, log):  # log: rank 0's lines (watch.log)
        self.path = os.path.join(directory, "metrics.csv")
        rows = []
        if os.path.exists(self.path):  # a resumed run's
            with open(self.path, newline="") as file:
                rows = [row for row in csv.DictReader(file) if _kept(row, start_step)]
        text = io.StringIO()
        writer = csv.DictWriter(text, self.FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        write_atomically(self.path, lambda file: file.write(text.getvalue().encode()))
        self.file = open(self.path, "a", newline="")
        self.writer = csv.DictWriter(self.file, self.FIELDS, lineterminator="\n")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            self.events = None
            no_events = "no TensorBoard events (pip install tensorboard for them)"
            log(f"--log-dir: writing {self.path}; {no_events}")
        else:  # purge_step: drops the events after the checkpoint
            self.events = SummaryWriter(directory, purge_step=start_step + 1)

    def write(self, **row):  # flushed: a kill loses no row before the checkpoint
        self.writer.writerow(row)
        self.file.flush()
        if self.events:
            for name, value in row.items():
                if name not in ("step", "epoch") and value is not None:
                    self.events.add_scalar(name, value, row["step"])
            self.events.flush()

    def close(self):
        self.file.close()
        if self.events:
            self.events.close()


def _kept(row, start_step):  # whole, from before the checkpoint (or its step's training row)
    if None in row.values():
        return False
    step = int(row["step"])
    return step < start_step or (step == start_step and bool(row["train_loss"]))
