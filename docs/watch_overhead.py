"""What watching a run costs: steady-state samples/s of train_ddp.py with rank 0's progress bar
drawn in a terminal and --log-dir's CSV (and TensorBoard events, where installed) on, beside the
same run piped with neither. Prints a JSON line; the runs alternate, so a machine's drift falls on
both.

    python docs/watch_overhead.py                       # 2 CPU processes, 6 pairs of runs
    python docs/watch_overhead.py --pairs 3 --steps 600

The bar redraws at most 10 times a second from the host's clock, and the CSV row is written at
logging steps, which already wait for the device and the other ranks: neither adds a synchronisation
per step. Whole runs on a shared machine move by a few percent from one to the next, more than what
is measured, so the script also times the host work alone: watch.Progress's per-step cost with and
without the bar and the CSV, in this process.
"""

import argparse
import json
import os
import pty
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from compare import ROOT, steady_state  # noqa: E402  the steady state that compare.py reports

parser = argparse.ArgumentParser()
parser.add_argument("--pairs", type=int, default=6)
parser.add_argument("--steps", type=int, default=400)
parser.add_argument("--ranks", type=int, default=2)
args = parser.parse_args()


def run(watched, directory):
    """samples/s of one run's steady state; ``watched``: in a pseudo-terminal (the bar drawn) with
    --log-dir."""
    metrics = Path(directory) / f"{'watched' if watched else 'plain'}.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.ranks}",
        "train_ddp.py",
        "--dataset",
        "synthetic",
        "--max-steps",
        str(args.steps),
        "--epochs",
        "100",
        "--no-eval",
        "--metrics",
        metrics,
    ]
    command += ["--log-dir", Path(directory) / "log"] if watched else []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if watched:  # a terminal's: rank 0 draws the bar; read and dropped as a terminal would show it
        master, replica = pty.openpty()
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdin=replica, stdout=replica, stderr=replica
        )
        os.close(replica)
        drain = threading.Thread(
            target=lambda: [None for _ in iter(lambda: _read(master), b"")], daemon=True
        )
        drain.start()
        process.wait()
        drain.join(10)
        os.close(master)
    else:
        process = subprocess.run(command, cwd=ROOT, env=env, capture_output=True)
    if process.returncode:
        sys.exit(
            f"watch_overhead.py: {' '.join(map(str, command))} failed with exit code "
            f"{process.returncode}"
        )
    return steady_state(json.loads(metrics.read_text()))[1]


def _read(fd):
    try:
        return os.read(fd, 65536)
    except OSError:  # every process holding the terminal has ended
        return b""


def host_cost(watched, steps=20_000, log_every=20):
    """Microseconds of host time a step spends in watch.Progress: the bar drawn on a pseudo-terminal
    and a CSV row at each logging step (watched), or neither; measured in this process, no training.
    """
    sys.path.insert(0, str(ROOT))
    from plumbing import watch

    master, replica = pty.openpty()
    drain = threading.Thread(
        target=lambda: [None for _ in iter(lambda: _read(master), b"")], daemon=True
    )
    drain.start()
    stdout, sys.stdout = (
        sys.stdout,
        (open(os.ttyname(replica), "w") if watched else open(os.devnull, "w")),
    )
    try:
        with tempfile.TemporaryDirectory() as directory:
            plan = types.SimpleNamespace(total_steps=steps, global_batch_size=128)
            flags = dict(log_every=log_every, log_dir=directory if watched else None)
            flags = types.SimpleNamespace(**flags, profile_steps=None)
            progress = watch.Progress(plan, flags, torch.device("cpu"))
            progress.start_epoch(0)
            start = time.perf_counter()
            for step in range(steps):
                progress.count_step()
                if progress.is_logging_step(end_of_epoch=False):
                    progress.record_loss(1.0, "loss (all ranks)", 1e-3)
            seconds = time.perf_counter() - start
            progress.close()
    finally:
        sys.stdout.close()
        sys.stdout = stdout
        os.close(replica)
    return seconds / steps * 1e6


rates = {"watched": [], "plain": []}
with tempfile.TemporaryDirectory() as directory:
    for _ in range(args.pairs):
        for watched in (True, False):
            rates["watched" if watched else "plain"].append(run(watched, directory))
watched, plain = (statistics.median(rates[k]) for k in ("watched", "plain"))
print(
    json.dumps(
        {
            "ranks": args.ranks,
            "steps": args.steps,
            "pairs": args.pairs,
            "median_samples_per_second": {
                "bar_and_log_dir": round(watched),
                "neither": round(plain),
            },
            "ratio": round(watched / plain, 4),
            "runs": rates,
            "host_us_per_step": {
                "bar_and_log_dir": round(host_cost(True), 2),
                "neither": round(host_cost(False), 2),
            },
        }
    )
)
