"""What the stop agreement costs: steady-state samples/s of train_ddp.py on 2 CPU processes with the
ranks comparing their signals about once a second (failures.StopSignals.SECONDS = 1, the scripts'
own), beside the same run that compares only at logging steps (as the old plumbing did) and one that
compares at every step. Prints a JSON line; the runs rotate, so a machine's drift falls on all
three.

    python benchmarks/stop_check.py                       # 2 CPU processes, 5 rounds of 3 runs
    python benchmarks/stop_check.py --rounds 3 --steps 600

Each run is train_ddp.py itself, started through this file with StopSignals.SECONDS set first
(--seconds).
"""

import argparse
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import ROOT, steady_state  # noqa: E402  the steady state that compare.py reports

MODES = {"every second": 1.0, "logging steps only": float("inf"), "every step": 0.0}


def train(seconds, script_args):  # in a worker: the script, with the agreement's interval set
    sys.path.insert(0, str(ROOT))
    from plumbing import failures

    failures.StopSignals.SECONDS = seconds
    sys.argv = ["train_ddp.py", *script_args]
    runpy.run_path(str(ROOT / "train_ddp.py"), run_name="__main__")


def run(seconds, steps, ranks, directory):
    """samples/s of one run's steady state."""
    metrics = Path(directory) / f"{seconds}.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        __file__,
        "--worker",
        str(seconds),
        "--dataset",
        "synthetic",
        "--max-steps",
        str(steps),
        "--epochs",
        "100",
        "--log-every",
        "200",
        "--no-eval",
        "--metrics",
        metrics,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    process = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if process.returncode:
        sys.exit(
            "stop_check.py: a run failed with exit code "
            f"{process.returncode}:\n{process.stderr[-2000:]}"
        )
    return steady_state(json.loads(metrics.read_text()))[1]


def main():
    if sys.argv[1:2] == ["--worker"]:
        return train(float(sys.argv[2]), sys.argv[3:])
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    rates = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as directory:
        for _ in range(args.rounds):
            for mode, seconds in MODES.items():
                rates[mode].append(run(seconds, args.steps, args.ranks, directory))
    medians = {mode: statistics.median(values) for mode, values in rates.items()}
    base = medians["logging steps only"]
    print(
        json.dumps(
            {
                "ranks": args.ranks,
                "steps": args.steps,
                "rounds": args.rounds,
                "samples_per_second": rates,
                "median": medians,
                "every_second_over_logging_only": medians["every second"] / base,
                "every_step_over_logging_only": medians["every step"] / base,
            }
        )
    )


if __name__ == "__main__":
    main()
