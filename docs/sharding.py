"""FSDP's options measured: --sharding full, grad-op and hybrid, and --activation-checkpointing.

    python docs/sharding.py                 # about 8 minutes on 2 cores
    python docs/sharding.py --rounds 1      # one speed round instead of 3
    python docs/sharding.py --rounds 1 --steps 2 --width 2  # the smoke test's: seconds a run

Three tables, each from real runs, one thread per process, synthetic data:
  memory   train_fsdp.py (and train_ddp.py on one process) at --width 32 (28.2M parameters), batch 8
           per rank, AdamW, 2 steps: `state_bytes` and `peak_memory_bytes` (the process's peak
           resident memory on a CPU) of the largest rank, from --metrics; and beside them, from
           benchmarks/fsdp_memory.py (the same wrapping, counted tensor by tensor), the peak bytes
           of tensors per rank during a step and the unsharded weights held at that peak.
  activations  benchmarks/fsdp_memory.py at width 1 and batch 64, where activations outweigh the
           weights: what forward leaves for backward, and the peak, without and with checkpointing.
  speed    train_fsdp.py on 2 ranks (train_ddp.py beside it), width 1, batch 64 per rank, 200 steps:
           samples/s, median of --rounds interleaved rounds. Only 2 ranks: hybrid needs 4, and 4
           processes on 2 cores measure the sharing of the cores, not the layout.
Prints the tables and writes sharding.json to --out.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from compare import ROOT, launch, machine  # noqa: E402

HYBRID = ["--sharding", "hybrid", "--replicate-degree", "2"]
# (label, script, ranks, flags, shard group size: how many ranks share one copy of the state)
MEMORY = [
    ("DDP", "train_ddp.py", 1, [], 1),
    ("full", "train_fsdp.py", 2, ["--sharding", "full"], 2),
    ("grad-op", "train_fsdp.py", 2, ["--sharding", "grad-op"], 2),
    (
        "full + activation checkpointing",
        "train_fsdp.py",
        2,
        ["--sharding", "full", "--activation-checkpointing"],
        2,
    ),
    ("hybrid, 2 groups x 2 shards", "train_fsdp.py", 4, HYBRID, 2),
    ("full", "train_fsdp.py", 4, ["--sharding", "full"], 4),
]
SPEED = [  # (label, script, flags), all on 2 ranks
    ("DDP", "train_ddp.py", []),
    ("full", "train_fsdp.py", ["--sharding", "full"]),
    ("grad-op", "train_fsdp.py", ["--sharding", "grad-op"]),
    (
        "full + activation checkpointing",
        "train_fsdp.py",
        ["--sharding", "full", "--activation-checkpointing"],
    ),
]


def torchrun(ranks):
    return (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        if ranks > 1
        else []
    )


def script(name, ranks, flags, metrics, timeout):
    """Run a training script; return its metrics."""
    print(f"{name} on {ranks} process(es) {' '.join(flags)}", flush=True)
    launch(
        [
            sys.executable,
            *torchrun(ranks),
            ROOT / name,
            "--dataset",
            "synthetic",
            "--seed",
            "0",
            "--no-eval",
            "--device",
            "cpu",
            "--metrics",
            metrics,
            *flags,
        ],
        timeout,
    )
    return json.loads(Path(metrics).read_text())


def tensors(ranks, flags, timeout):
    """benchmarks/fsdp_memory.py under torchrun; its JSON line."""
    print(f"benchmarks/fsdp_memory.py on {ranks} processes {' '.join(flags)}", flush=True)
    (output,) = launch(
        [sys.executable, *torchrun(ranks), ROOT / "benchmarks" / "fsdp_memory.py", *flags], timeout
    )
    return json.loads(output.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds of the speed runs"
    )
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per speed run")
    parser.add_argument("--timeout", type=int, default=900, help="seconds one run may take")
    parser.add_argument("--width", type=int, default=32, help="BabyCNN's, for the memory table")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results"))
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="sharding-"))
    results = {"machine": machine(), "memory": [], "activations": [], "speed": []}

    width, batch = args.width, 8
    for label, name, ranks, flags, group in MEMORY:
        metrics = script(
            name,
            ranks,
            [
                "--width",
                str(width),
                "--batch-size",
                str(batch),
                "--max-steps",
                "2",
                "--optimizer",
                "adamw",
                *flags,
            ],
            scratch / "m.json",
            args.timeout,
        )
        row = {
            "layout": label,
            "script": name,
            "ranks": ranks,
            "param_count": metrics["param_count"],
            "state_bytes": max(r["state_bytes"] for r in metrics["ranks"]),
            "expected_state_bytes": 16 * metrics["param_count"] / group,
            "peak_rss_bytes": max(r["peak_memory_bytes"] for r in metrics["ranks"]),
        }
        if name == "train_fsdp.py":
            counted = tensors(
                ranks, ["--width", str(width), "--batch-size", str(batch), *flags], args.timeout
            )
            row.update(
                peak_tensor_bytes=counted["peak"]["total"],
                unsharded_param_bytes_at_peak=counted["peak"]["unsharded_param"],
            )
        results["memory"].append(row)

    for flags in ([], ["--activation-checkpointing"]):
        counted = tensors(2, ["--width", "1", "--batch-size", "64", *flags], args.timeout)
        results["activations"].append(
            {
                "activation_checkpointing": bool(flags),
                "kept_for_backward_bytes": counted["after_forward"]["act"],
                "peak_tensor_bytes": counted["peak"]["total"],
                "peak_activation_and_temporary_bytes": counted["peak"]["act"]
                + counted["peak"]["temp"],
            }
        )

    runs = {label: [] for label, *_ in SPEED}
    for round_ in range(args.rounds):
        for label, name, flags in SPEED:
            metrics = script(
                name,
                2,
                ["--batch-size", "64", "--max-steps", str(args.steps), "--epochs", "1000", *flags],
                scratch / "s.json",
                args.timeout,
            )
            runs[label].append(metrics["samples_per_second"])
    for label, speeds in runs.items():
        ratios = [s / d for s, d in zip(speeds, runs["DDP"])]
        results["speed"].append(
            {
                "layout": label,
                "samples_per_second": statistics.median(speeds),
                "all_rounds": speeds,
                "vs_ddp": statistics.median(ratios),
                "vs_ddp_min": min(ratios),
                "vs_ddp_max": max(ratios),
            }
        )
    results["rounds"], results["steps"] = args.rounds, args.steps

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sharding.json").write_text(json.dumps(results, indent=2) + "\n")
    print(markdown(results))
    print(f"wrote {out / 'sharding.json'}")


def mib(value):
    return f"{value / 2**20:,.1f} MiB"


def markdown(r):
    lines = [
        "| layout | ranks | `state_bytes`, largest rank | 16·P / shard group | peak tensor bytes, "
        "largest rank "
        "| unsharded weights at that peak | peak resident memory |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in r["memory"]:
        counted = row.get("peak_tensor_bytes")
        lines.append(
            f"| {row['layout']} | {row['ranks']} | {mib(row['state_bytes'])} | "
            f"{mib(row['expected_state_bytes'])} "
            f"| {mib(counted) if counted else ''} "
            f"| {mib(row['unsharded_param_bytes_at_peak']) if counted else ''} | "
            f"{mib(row['peak_rss_bytes'])} |"
        )
    lines += [
        "",
        "| width 1, batch 64, full, 2 ranks | activations left by forward | peak activations + "
        "temporaries "
        "| peak tensor bytes |",
        "| --- | --- | --- | --- |",
    ]
    for row in r["activations"]:
        label = "with --activation-checkpointing" if row["activation_checkpointing"] else "without"
        lines.append(
            f"| {label} | {mib(row['kept_for_backward_bytes'])} | "
            f"{mib(row['peak_activation_and_temporary_bytes'])} "
            f"| {mib(row['peak_tensor_bytes'])} |"
        )
    spread = r["rounds"] > 1
    lines += [
        "",
        f"| 2 ranks, width 1, batch 64 | samples/s (median of {r['rounds']}) | vs DDP |",
        "| --- | --- | --- |",
    ]
    for row in r["speed"]:
        ratio = f"{row['vs_ddp']:.2f}" + (
            f" ({row['vs_ddp_min']:.2f}–{row['vs_ddp_max']:.2f})" if spread else ""
        )
        lines.append(f"| {row['layout']} | {row['samples_per_second']:,.0f} | {ratio} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    began = time.monotonic()
    main()
    print(f"sharding: {time.monotonic() - began:.0f} s")
