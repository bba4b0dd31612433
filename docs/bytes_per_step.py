"""Count the bytes each rank sends in one optimizer step, per strategy, from the real collectives.

    python docs/bytes_per_step.py            # BabyCNN and the GPT, DDP, FSDP and TP: 1 minute
    python docs/bytes_per_step.py --model gpt --strategy tp --batch-size 4
    python docs/bytes_per_step.py --model gpt --precision bf16   # the rule's dtype

For each model and strategy it launches the real script under torchrun on --world-size CPU processes
(gloo), for --step steps, with `--profile-steps S:S --log-dir DIR`: each rank writes a trace of its
last step (benchmarks/read_trace.py reads the same files). train_tp.py runs with --tp equal to the
world size (dp 1), so every collective spans all W ranks. The defaults are the scripts' own: the
GPT (--model gpt, the bundled Tiny Shakespeare) at batch 16 per replica, BabyCNN at 64.

It counts the c10d calls on each rank's main thread (c10d::allreduce_, _allgather_base_, the
coalesced forms DTensor issues, and so on). For each call, n is the bytes of the whole tensor, as in
benchmarks/collectives.py: the input of an all-reduce or a broadcast, the input of a reduce-scatter,
the output of an all-gather (each rank holds n / W of it). The element size comes from the dtype of
the gloo event that ran the call (of the next two in the order the calls were issued, which gloo's
two worker threads may swap, the first whose size matches). The bytes one rank sends are the ring
algorithm's, the way NCCL runs them:

    all-gather, reduce-scatter:  (W - 1) / W * n    (W - 1 steps, each passing a shard of n / W)
    all-reduce:              2 * (W - 1) / W * n    (a reduce-scatter, then an all-gather)
    broadcast:                   (W - 1) / W * n    (n down a chain of W ranks: the average)

Gloo runs a reduce-scatter as an all-reduce of the whole tensor (the report says what gloo ran), so
on a CPU its reduce-scatters send twice the ring's bytes; the table keeps the ring's figure, the
cost on a GPU, and the JSON adds gloo's own as sent_per_rank_gloo. The calls after the optimizer
step are the loop's bookkeeping, not the step's: the stop agreement (a 2-element all-reduce, at
logging steps and about once a second) and the logged loss's all-reduce (1 element, at logging
steps). They are listed apart and left out of the totals.

Prints a table; writes the figures as JSON to --out, by default (for the default run only)
docs/results/bytes_per_step.json.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"ddp": "train_ddp.py", "fsdp": "train_fsdp.py", "tp": "train_tp.py"}
MODELS = ("cnn", "gpt")
OUT = ROOT / "docs" / "results" / "bytes_per_step.json"
# c10d's op: (the kind, the argument holding the whole tensor, whether that holds one rank's shard)
OPS = {
    "allreduce_": ("all_reduce", 0, False),
    "allreduce_coalesced_": ("all_reduce", 0, False),
    "broadcast_": ("broadcast", 0, False),
    "_allgather_base_": ("all_gather", 0, False),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, False),
    "allgather_": ("all_gather", 1, True),
    "_reduce_scatter_base_": ("reduce_scatter", 1, False),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, False),
    "reduce_scatter_": ("reduce_scatter", 1, True),
}
# the ring's bytes sent per rank, as a multiple of (W - 1) / W * n
RING = {"all_gather": 1, "reduce_scatter": 1, "broadcast": 1, "all_reduce": 2}
ITEM_BYTES = {
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "long int": 8,
    "int": 4,
    "bool": 1,
    "unsigned char": 1,
    "signed char": 1,
}


def numel(dims):
    """Elements of a trace's tensor dims: a shape, or a list of shapes (a TensorList)."""
    if dims and isinstance(dims[0], list):
        return sum(numel(d) for d in dims)
    return math.prod(dims)


def ran_elements(event, world_size):
    """The elements of the whole tensor a gloo event ran: its input's, an all-gather's times W."""
    gathers = event["name"] == "gloo:all_gather"
    return numel(event["args"]["Input Dims"][0]) * (world_size if gathers else 1)


def read_step(path, world_size):
    """{"step": [calls], "after_step": [calls]} of one rank's trace of one step: each call {kind,
    elements, n, item_bytes, gloo}, in the order issued."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    main = Counter(e["tid"] for e in events if e.get("cat") == "cpu_op").most_common(1)[0][0]
    events.sort(key=lambda e: e["ts"])
    steps = [e for e in events if e["tid"] == main and e["name"].startswith("Optimizer.step#")]
    if len(steps) != 1:
        raise SystemExit(f"{path}: {len(steps)} optimizer steps in the trace, not 1")
    step_end = steps[0]["ts"] + steps[0]["dur"]
    gloo = [e for e in events if e["name"].startswith("gloo:")]
    calls = {"step": [], "after_step": []}
    for e in events:
        if e["tid"] != main or not e["name"].startswith("c10d::"):
            continue
        op = e["name"].removeprefix("c10d::")
        if op not in OPS:
            raise SystemExit(f"{path}: {e['name']} is not a collective this benchmark counts")
        kind, arg, shard = OPS[op]
        elements = numel(e["args"]["Input Dims"][arg]) * (world_size if shard else 1)
        # gloo runs the calls in the order issued, but its 2 worker threads may start two calls
        # issued back to back in either order: the first of the next 2 events of the call's size
        ran = next((g for g in gloo[:2] if ran_elements(g, world_size) == elements), None)
        if ran is None:
            raise SystemExit(f"{path}: {e['name']} of {elements} elements, run as {gloo[:2]}")
        gloo.remove(ran)
        ran_kind = ran["name"].removeprefix("gloo:")
        item = ITEM_BYTES[ran["args"]["Input type"][0]]
        where = "step" if e["ts"] < step_end else "after_step"
        calls[where].append(
            {"kind": kind, "elements": elements, "n": elements * item, "gloo": ran_kind}
        )
    return calls


def summarize(calls, world_size):
    """{kind: {calls, n, sent}}: the calls of a kind, their bytes n, the ring's bytes sent."""
    kinds = {}
    for call in calls:
        row = kinds.setdefault(call["kind"], {"calls": 0, "n": 0, "sent": 0, "gloo": call["gloo"]})
        row["calls"] += 1
        row["n"] += call["n"]
    for kind, row in kinds.items():
        # whole bytes: exact for W = 2, and for the sharded kinds, whose n is a multiple of W
        row["sent"] = RING[kind] * (world_size - 1) * row["n"] // world_size
    return kinds


def count(model, strategy, world_size=2, step=3, batch_size=None, log=print, precision=None):
    """Run ``strategy``'s script on ``model`` for ``step`` steps; one figure set per rank."""
    with tempfile.TemporaryDirectory(prefix="bytes-") as log_dir:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world_size}",
            str(ROOT / SCRIPTS[strategy]),
            "--model",
            model,
            "--max-steps",
            str(step),
            "--profile-steps",
            f"{step}:{step}",
            "--log-dir",
            log_dir,
            "--no-eval",
            "--device",
            "cpu",
        ]
        command += ["--tp", str(world_size)] if strategy == "tp" else []
        command += ["--batch-size", str(batch_size)] if batch_size else []
        command += ["--precision", precision] if precision else []
        env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        env.pop("RANK", None)
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        if run.returncode:
            raise SystemExit(
                f"{' '.join(command)} failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}"
            )
        start = next((line for line in run.stdout.splitlines() if "rank(s)" in line), "")
        log(f"{model} {strategy}: {start}")
        ranks = []
        for rank in range(world_size):
            calls = read_step(Path(log_dir) / f"trace-rank{rank}.json", world_size)
            ranks.append({where: summarize(c, world_size) for where, c in calls.items()})
    for rank, figures in enumerate(ranks[1:], 1):
        if figures != ranks[0]:
            raise SystemExit(f"{model} {strategy}: rank {rank} sent other bytes than rank 0")
    step_kinds = ranks[0]["step"]
    return {
        "model": model,
        "strategy": strategy,
        "world_size": world_size,
        "batch_size": batch_size,
        "precision": precision,
        "start_line": start,
        "step": step_kinds,
        "after_step": ranks[0]["after_step"],
        "n": sum(row["n"] for row in step_kinds.values()),
        "sent_per_rank": sum(row["sent"] for row in step_kinds.values()),
        # gloo's own: its reduce-scatter is an all-reduce of the whole tensor
        "sent_per_rank_gloo": sum(
            RING[row["gloo"]] * (world_size - 1) * row["n"] // world_size
            for row in step_kinds.values()
        ),
    }


def table(results):
    lines = [
        f"{'model':<6} {'strategy':<9} {'collective':<31} {'calls':>5}  {'payload n (bytes)':>17}  "
        "sent per rank (bytes, ring)",
    ]
    for r in results:
        for where, label in (("step", ""), ("after_step", " (after the step)")):
            for kind, row in sorted(r[where].items()):
                gloo = "" if row["gloo"] == kind else f"  [gloo: {row['gloo']}]"
                lines.append(
                    f"{r['model']:<6} {r['strategy']:<9} {kind + label:<31} {row['calls']:>5}  "
                    f"{row['n']:>17,}  {row['sent']:>27,}{gloo}"
                )
        lines.append(
            f"{r['model']:<6} {r['strategy']:<9} {'the step':<31} "
            f"{sum(row['calls'] for row in r['step'].values()):>5}  {r['n']:>17,}  "
            f"{r['sent_per_rank']:>27,}  = {r['sent_per_rank'] / 1e6:.2f} MB"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, nargs="+", default=list(MODELS))
    parser.add_argument("--strategy", choices=tuple(SCRIPTS), nargs="+", default=list(SCRIPTS))
    parser.add_argument("--world-size", type=int, default=2, help="processes (and --tp for TP)")
    parser.add_argument("--step", type=int, default=3, help="the step counted (runs this many)")
    parser.add_argument("--batch-size", type=int, help="default: the script's for the model")
    parser.add_argument("--precision", choices=("fp32", "bf16"), help="default: the script's")
    parser.add_argument(
        "--out", "--metrics", type=Path, help="the JSON; default: " + str(OUT.relative_to(ROOT))
    )
    args = parser.parse_args()
    defaults = parser.parse_args([])
    if args.out is None and vars(args) == vars(defaults):  # a partial run leaves the results be
        args.out = OUT
    results = [
        count(model, strategy, args.world_size, args.step, args.batch_size, print, args.precision)
        for model in args.model
        for strategy in args.strategy
    ]
    print(table(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
