"""Read the traces that --profile-steps wrote: each rank's collectives and wait, step by step.

Per rank and step, the collectives the script issued in the forward, during the backward (with
backward work still to come, so they can overlap it) and after it, and the time the rank waited on
communication. Open the same files in https://ui.perfetto.dev to see each one.

    bash run_ddp.sh --max-steps 12 --profile-steps 10:10 --log-dir logs/trace
    python benchmarks/read_trace.py --log-dir logs/trace

The collectives are the c10d calls on the rank's main thread (the same on a GPU). The wait is the
time the main thread spent inside gloo's transfers (a send, a receive, a blocking collective): on a
CPU with gloo only, since on a GPU NCCL's kernels wait on the device instead (read them on the
timeline).
"""

import argparse
import json
import re
from collections import Counter
from pathlib import Path

KINDS = {
    "allreduce_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "broadcast_": "broadcast",
    "send": "send",
    "recv_": "recv",
}
# autograd's math (ConvolutionBackward0), not its bookkeeping
BACKWARD = re.compile(r"^\w+Backward\d*$")


def read_rank(path):
    """[{step_ms, wait_ms, issued: {kind: [in forward, during backward, after it]}}] for each step
    of one rank."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    main = Counter(e["tid"] for e in events if e.get("cat") == "cpu_op").most_common(1)[0][0]
    ops = sorted((e for e in events if e["tid"] == main), key=lambda e: e["ts"])
    steps, start = [], ops[0]["ts"]
    for end in [e["ts"] + e["dur"] for e in ops if e["name"].startswith("Optimizer.step#")]:
        now = [e for e in ops if start <= e["ts"] < end]
        backward = [e["ts"] for e in now if BACKWARD.match(e["name"])] or [end]
        issued = {}
        for e in now:
            kind = (
                KINDS.get(e["name"].removeprefix("c10d::"))
                if e["name"].startswith("c10d::")
                else None
            )
            if kind:
                phase = 0 if e["ts"] < backward[0] else 1 if e["ts"] < backward[-1] else 2
                issued.setdefault(kind, [0, 0, 0])[phase] += 1
        waits = [e for e in now if e["name"].startswith("gloo:")]
        steps.append(
            {
                "step_ms": (end - start) / 1e3,
                "wait_ms": sum(e["dur"] for e in waits) / 1e3,
                "issued": issued,
            }
        )
        start = end
    return steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--log-dir", type=Path, required=True, help="the run's --log-dir, with trace-rank*.json"
    )
    parser.add_argument("--metrics", type=Path, help="write the figures as JSON")
    args = parser.parse_args()
    paths = sorted(
        args.log_dir.glob("trace-rank*.json"), key=lambda p: int(p.stem.removeprefix("trace-rank"))
    )
    if not paths:
        parser.exit(
            2,
            f"error: no trace-rank*.json in {args.log_dir}: run with --profile-steps A:B --log-dir "
            "DIR\n",
        )
    ranks = [read_rank(path) for path in paths]
    for rank, steps in enumerate(ranks):
        for index, step in enumerate(steps):
            calls = "; ".join(
                f"{sum(n)} {kind} ({n[0]} in forward, {n[1]} during backward, {n[2]} after)"
                for kind, n in sorted(step["issued"].items())
            )
            print(
                f"rank {rank}, step {index + 1}: {step['step_ms']:.1f} ms, waiting on "
                "communication "
                f"{step['wait_ms']:.1f} ms ({step['wait_ms'] / step['step_ms']:.0%}); issued "
                f"{calls or 'nothing'}"
            )
    if args.metrics:
        args.metrics.write_text(json.dumps({"ranks": ranks}, indent=1))


if __name__ == "__main__":
    main()
