"""What a training step costs the host (the CPU that runs Python and launches the work), and what
train_ddp.py spends before its first step. Prints a Markdown table and writes host_overhead.json.

    OMP_NUM_THREADS=1 python benchmarks/host_overhead.py  # about 2 minutes on a 2-core CPU machine
    python benchmarks/host_overhead.py --device cuda                 # on a GPU

At batch 1 a BabyCNN step's arithmetic is a small part of its time, so the time per step is mostly
the host's: Python, the dispatcher, one launch per kernel (on a GPU the kernels run while the host
goes on). Rows, in microseconds per step, medians over --repeats rounds:
  bare loop         the model and the optimizer alone, on batches made before the clock starts
  bare loop in DDP  the same in DDP on a group of one: what train_ddp.py skips on one process
  train_ddp.py      one process, steady state from its metrics (batch indexing, loss sum, lr...)
Start-up: `python -c "import torch"`, and train_ddp.py's wall time for a run of one step without
evaluation on the bundled MNIST files (start, imports, data, model, one step, exit).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import ROOT, launch, machine, steady_state  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cpu", help="cpu or cuda")
parser.add_argument("--steps", type=int, default=2000, help="steps per timed run")
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
args = parser.parse_args()


def bare(*flags):
    command = [
        sys.executable,
        "benchmarks/bare_loop.py",
        "--device",
        args.device,
        "--steps",
        args.steps,
        "--batch-size",
        1,
        "--warmup",
        100,
        *flags,
    ]
    return json.loads(launch(command, timeout=600)[0].splitlines()[-1])["microseconds_per_step"]


def script(metrics):
    launch(
        [
            sys.executable,
            "train_ddp.py",
            "--device",
            args.device,
            "--dataset",
            "synthetic",
            "--batch-size",
            1,
            "--max-steps",
            args.steps,
            "--epochs",
            10**6,
            "--no-eval",
            "--metrics",
            metrics,
        ],
        timeout=600,
    )
    return 1e6 / steady_state(json.loads(Path(metrics).read_text()))[1]


def wall(command):
    start = time.perf_counter()
    launch(command, timeout=600)
    return time.perf_counter() - start


rounds = []
metrics = args.out / ".host_overhead_metrics.json"
try:
    for _ in range(args.repeats):
        rounds.append(
            {
                "bare_loop": bare(),
                "bare_loop_ddp": bare("--ddp"),
                "train_ddp": script(metrics),
                "import_torch_seconds": wall([sys.executable, "-c", "import torch"]),
                "first_step_seconds": wall(
                    [
                        sys.executable,
                        "train_ddp.py",
                        "--device",
                        args.device,
                        "--max-steps",
                        1,
                        "--no-eval",
                    ]
                ),
            }
        )
finally:
    metrics.unlink(missing_ok=True)
results = {
    "machine": machine(),
    "device": args.device,
    "steps": args.steps,
    "batch_size": 1,
    "rounds": rounds,
    **{key: statistics.median(r[key] for r in rounds) for key in rounds[0]},
}
results["ddp_cost"] = results["bare_loop_ddp"] - results["bare_loop"]
results["script_cost"] = results["train_ddp"] - results["bare_loop"]
m = results["machine"]
table = "\n".join(
    [
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['gpus']} GPUs, torch {m['torch']}; device "
        f"{args.device}, batch 1, "
        f"{args.steps} steps per run, medians of {args.repeats} rounds.",
        "",
        "| run | µs per step | over the bare loop |",
        "| --- | --- | --- |",
        f"| bare loop | {results['bare_loop']:,.0f} | |",
        f"| bare loop in DDP, one process | {results['bare_loop_ddp']:,.0f} | "
        f"{results['ddp_cost']:+,.0f} µs |",
        f"| train_ddp.py, one process | {results['train_ddp']:,.0f} | "
        f"{results['script_cost']:+,.0f} µs |",
        "",
        f"Start-up: `import torch` {results['import_torch_seconds']:.2f} s; train_ddp.py, a 1-step "
        "run on MNIST, "
        f"{results['first_step_seconds']:.2f} s from start to exit.",
    ]
)
args.out.mkdir(parents=True, exist_ok=True)
name = "host_overhead" if args.device == "cpu" else f"host_overhead_{args.device}"
(args.out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
print(table)
print(f"wrote {args.out / (name + '.json')}")
