"""How long a dead rank goes unnoticed: SIGKILL rank 1 of a training 2-rank DDP job, time the rest.

    python docs/failure_detection.py              # 5 trials, about a minute on 2 cores
    python docs/failure_detection.py --trials 10

Each trial starts `torchrun --standalone --nproc-per-node=2 train_ddp.py` (gloo, CPU, one thread per
process), waits until it has trained for --train-seconds, finds rank 1 among torchrun's children by
the RANK in its environment and SIGKILLs it. From that moment it times
  (a) rank 0's first error line (gloo's "Connection closed by peer" or similar, raised in the
      collective it was in or entered next), read from the job's output as it arrives, and the end
      of the rank 0 process;
  (b) the end of torchrun itself (it sees the dead worker, stops the other one, and exits non-zero).
Prints each trial, then the median, minimum and maximum of each figure, and a JSON line.
A rank that hangs instead of dying is another matter: its peers wait in their next collective
until the process group's timeout (10 minutes in the scripts); that is not measured here.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ERRORS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "DistBackendError",
    "Broken pipe",
)


def children_by_rank(parent):
    """{RANK: pid} of ``parent``'s child processes, read from /proc (torchrun's workers)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != parent:
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except (OSError, ValueError, IndexError):
            continue
        if b"RANK" in environ:
            found[int(environ[b"RANK"])] = int(entry)
    return found


def running(pid):
    """False once ``pid`` has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def trial(train_seconds, timeout):
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(ROOT),
        CUDA_VISIBLE_DEVICES="",
    )
    env.pop("RANK", None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(ROOT / "train_ddp.py"),
        "--dataset",
        "synthetic",
        "--epochs",
        "1000",
        "--no-eval",
    ]
    job = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    lines = []  # (arrival time, line)

    def read():
        for line in iter(job.stdout.readline, b""):
            lines.append((time.monotonic(), line.decode(errors="replace")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + timeout
        # its last line before training
        while not any("DDP on 2 rank(s)" in line for _, line in lines):
            if job.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    "the job never started training:\n" + "".join(line for _, line in lines)[-3000:]
                )
            time.sleep(0.05)
        time.sleep(train_seconds)
        workers = children_by_rank(job.pid)
        killed = time.monotonic()
        os.kill(workers[1], signal.SIGKILL)
        rank0_end = None
        while job.poll() is None:
            if rank0_end is None and not running(workers[0]):
                rank0_end = time.monotonic()
            if time.monotonic() > killed + timeout:
                raise RuntimeError(f"torchrun still running {timeout} s after the kill")
            time.sleep(0.001)
        torchrun_end = time.monotonic()
        reader.join(5)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    rank0_end = rank0_end or torchrun_end
    first_error = next(
        (t for t, line in lines if t >= killed and any(e in line for e in ERRORS)), None
    )
    return {
        "rank0_error_line_s": None if first_error is None else first_error - killed,
        "rank0_exit_s": rank0_end - killed,
        "torchrun_exit_s": torchrun_end - killed,
        "torchrun_exit_code": job.returncode,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument(
        "--train-seconds", type=float, default=2.0, help="training time before the kill"
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds a start or an ending may take"
    )
    args = parser.parse_args()
    trials = []
    for number in range(1, args.trials + 1):
        result = trial(args.train_seconds, args.timeout)
        trials.append(result)
        print(
            f"trial {number}: "
            + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()
            ),
            flush=True,
        )
    print("\n| from SIGKILL of rank 1 to | median | min | max |\n| --- | --- | --- | --- |")
    summary = {}
    for key, label in (
        ("rank0_error_line_s", "rank 0's first error line"),
        ("rank0_exit_s", "rank 0's exit"),
        ("torchrun_exit_s", "torchrun's exit"),
    ):
        values = [t[key] for t in trials if t[key] is not None]
        if values:
            summary[key] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
                "n": len(values),
            }
            print(
                f"| {label} | {summary[key]['median']:.3f} s | {min(values):.3f} s | "
                f"{max(values):.3f} s |"
                + (
                    ""
                    if len(values) == len(trials)
                    else f" ({len(values)} of {len(trials)} trials)"
                )
            )
        else:
            print(f"| {label} | none seen | | |")
    print(json.dumps({"trials": trials, "summary": summary}))


if __name__ == "__main__":
    main()
