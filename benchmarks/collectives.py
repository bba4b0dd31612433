"""What a collective costs as the message grows: time against bytes, and the α–β model fitted to it.

    # gloo on the CPU, 2 and 4 processes: about 2 minutes on 2 cores
    python benchmarks/collectives.py
    python benchmarks/collectives.py --quick  # 2 processes, fewer sizes and repeats: seconds
    # NCCL, one process per GPU (needs 2 or more GPUs)
    python benchmarks/collectives.py --device cuda
    # no timing: refit the saved JSON's points, redraw the plot
    python benchmarks/collectives.py --refit

Starts W processes (torch.multiprocessing, spawn; one thread each) for each world size W, and times
broadcast (from rank 0), all_reduce (sum), reduce_scatter and all_gather (the single-tensor forms),
and send/recv between ranks 0 and 1 (a ping-pong, halved), on float32 tensors of 4 bytes to 64 MiB,
a factor of 4 apart. The message size n is the bytes of the whole tensor: the input of broadcast,
all_reduce and reduce_scatter, the output of all_gather (so each rank's shard is n / W). A point is
the median over --repeats samples of the slowest rank's time per call, each sample a run of calls
long enough to time (at least --sample-ms); with --rounds, the median of that over rounds.

Each collective's points are fitted with t = α + n·β in two parts a reader can redo by hand: α, the
latency a call pays whatever its size, is the median time of the messages up to 64 KiB (the flat
part; a median, so that one odd point does not move it); β, the seconds per byte (1/β the
bandwidth), is the median of (t − α) / n over the messages of 4 MiB and more (the straight part).
For all_reduce the fit is set beside the ring model t = 2(W−1)·α' + 2(W−1)/W · n·β', with α' and β'
those of one send/recv. Prints the points and the fits, writes collectives.json to --out and the
plot (log-log: points, fitted lines) to --plot.
"""

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
COLLECTIVES = ["broadcast", "all_reduce", "reduce_scatter", "all_gather", "send_recv"]
# torch 2.14 renamed the single-tensor forms (reduce_scatter_tensor and all_gather_into_tensor still
# work there, with a FutureWarning); torch 2.9 has only the old names. The same calls either way.
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo; cuda: NCCL"
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", help="default: 2 4 (--quick: 2)")
    parser.add_argument(
        "--max-bytes", type=int, help="the largest message; default 64 MiB (--quick: 4 MiB)"
    )
    parser.add_argument(
        "--factor", type=int, help="from one size to the next; default 4 (--quick: 16)"
    )
    parser.add_argument("--repeats", type=int, help="samples per point; default 7 (--quick: 3)")
    parser.add_argument(
        "--rounds", type=int, help="whole sweeps, medians over them; default 3 (--quick: 1)"
    )
    parser.add_argument(
        "--sample-ms",
        type=float,
        help="a sample's calls take at least this; default 20 (--quick: 2)",
    )
    parser.add_argument("--quick", action="store_true", help="the smoke test's size: a few seconds")
    parser.add_argument(
        "--refit",
        action="store_true",
        help="measure nothing: refit the points already in --out's JSON, rewrite it and the plot",
    )
    parser.add_argument(
        "--out",
        help="where collectives.json goes; default benchmarks/results (--quick: a temporary "
        "folder)",
    )
    parser.add_argument(
        "--plot", help="default docs/images/collectives.png (--quick: beside the JSON)"
    )
    parser.add_argument("--metrics", help="write the report's JSON here too (the docs' exercises)")
    args = parser.parse_args()
    quick = args.quick
    defaults = dict(
        world_sizes=[2] if quick else [2, 4],
        max_bytes=4 << 20 if quick else 64 << 20,
        factor=16 if quick else 4,
        repeats=3 if quick else 7,
        rounds=1 if quick else 3,
        sample_ms=2.0 if quick else 20.0,
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    suffix = "" if args.device == "cpu" else "_nccl"
    if args.out is None:
        args.out = (
            tempfile.mkdtemp(prefix="collectives-")
            if quick
            else str(ROOT / "benchmarks" / "results")
        )
    if args.plot is None:
        args.plot = (
            str(Path(args.out) / f"collectives{suffix}.png")
            if quick
            else str(ROOT / "docs" / "images" / f"collectives{suffix}.png")
        )
    args.json = str(Path(args.out) / f"collectives{suffix}.json")
    return args


def sizes(max_bytes, factor):
    n, found = 4, []
    while n <= max_bytes:
        found.append(n)
        n *= factor
    return found


# ---- the workers ----


def worker(rank, world_size, port, args, path):
    torch.set_num_threads(1)
    if args.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        points = {name: [] for name in COLLECTIVES}
        for name in COLLECTIVES:
            for n in sizes(args.max_bytes, args.factor):
                numel = n // 4
                if numel % world_size and name in ("reduce_scatter", "all_gather"):
                    continue  # the whole tensor must split into W equal shards: from 4·W bytes on
                call = operation(name, numel, rank, world_size, device)
                points[name].append([n, time_one(call, args, device)])
        if rank == 0:
            Path(path).write_text(json.dumps(points))
    finally:
        dist.destroy_process_group()


def operation(name, numel, rank, world_size, device):
    """A function that makes one call of the collective on fresh tensors of the size (made once)."""
    whole = torch.ones(numel, device=device)
    shard = torch.ones(numel // world_size, device=device)
    if name == "broadcast":
        return lambda: dist.broadcast(whole, src=0)
    if name == "all_reduce":
        return lambda: dist.all_reduce(whole)
    if name == "reduce_scatter":
        return lambda: REDUCE_SCATTER(shard, whole)
    if name == "all_gather":
        return lambda: ALL_GATHER(whole, shard)

    def ping_pong():  # rank 0 sends, rank 1 sends it back; the other ranks wait at the barrier
        if rank == 0:
            dist.send(whole, 1)
            dist.recv(whole, 1)
        elif rank == 1:
            dist.recv(whole, 0)
            dist.send(whole, 0)

    return ping_pong


def time_one(call, args, device):
    """Median over --repeats samples of the slowest rank's seconds per call (send_recv: per round
    trip, halved later). A sample is `calls` calls back to back, after a barrier; every rank makes
    the same number."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    call()  # the first call sets up buffers and connections
    sync()
    began = time.perf_counter()
    call()
    sync()
    first = torch.tensor([time.perf_counter() - began], dtype=torch.float64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MAX)
    calls = max(1, min(200, round(args.sample_ms / 1000 / max(first.item(), 1e-7))))
    samples = []
    for _ in range(args.repeats):
        dist.barrier()
        began = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        samples.append((time.perf_counter() - began) / calls)
    slowest = torch.tensor(samples, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a collective is done when its last rank is
    return statistics.median(slowest.tolist())


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sweep(world_size, args):
    """One sweep on world_size processes: {collective: [[bytes, seconds], ...]}."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "points.json"
        mp.spawn(
            worker, args=(world_size, free_port(), args, str(path)), nprocs=world_size, join=True
        )
        points = json.loads(path.read_text())
    points["send_recv"] = [
        [n, t / 2] for n, t in points["send_recv"]
    ]  # one way: half the round trip
    return points


# ---- the model ----

SMALL, LARGE = 64 << 10, 4 << 20  # the flat part ends, the straight part begins (bytes)


def fit(points):
    """α and β of t = α + n·β: α the median time up to SMALL bytes, β the median of (t − α) / n from
    LARGE bytes on. Medians, so that one odd point moves neither. With no point in a range, its
    nearest point stands in."""
    small = [t for n, t in points if n <= SMALL] or [points[0][1]]
    large = [(n, t) for n, t in points if n >= LARGE] or [points[-1]]
    alpha = statistics.median(small)
    return alpha, statistics.median((t - alpha) / n for n, t in large)


def ring(world_size, alpha, beta):
    """The ring all-reduce's α and β from one link's: 2(W−1) steps, each moving n/W bytes."""
    return 2 * (world_size - 1) * alpha, 2 * (world_size - 1) / world_size * beta


def analyse(world_size, rounds):
    """Per collective: the median points over the rounds, then fitted."""
    medians = {}
    for name in COLLECTIVES:
        by_size = {}
        for points in rounds:
            for n, t in points[name]:
                by_size.setdefault(n, []).append(t)
        medians[name] = [[n, statistics.median(ts)] for n, ts in sorted(by_size.items())]
    return fitted_entry(world_size, medians)


def fitted_entry(world_size, medians):
    """Per collective: its points and their fit; for all_reduce, the ring model beside it."""
    result = {"world_size": world_size, "collectives": {}}
    for name in COLLECTIVES:
        points = medians[name]
        alpha, beta = fit(points)
        result["collectives"][name] = {"points": points, "alpha_s": alpha, "beta_s_per_byte": beta}
    link = result["collectives"]["send_recv"]
    fitted = result["collectives"]["all_reduce"]
    alpha, beta = ring(world_size, link["alpha_s"], link["beta_s_per_byte"])
    fitted["ring_model"] = {
        "latency_steps": 2 * (world_size - 1),
        "share_of_tensor": 2 * (world_size - 1) / world_size,
        "alpha_s": alpha,
        "beta_s_per_byte": beta,  # predicted from send_recv's fit
        "alpha_vs_fit": fitted["alpha_s"] / alpha,
        "beta_vs_fit": fitted["beta_s_per_byte"] / beta,
        # the fit's α and β read back through the ring model: one link's, as all_reduce sees it
        "link_alpha_s": fitted["alpha_s"] / (2 * (world_size - 1)),
        "link_beta_s_per_byte": fitted["beta_s_per_byte"] * world_size / (2 * (world_size - 1)),
    }
    return result


# ---- output ----


def describe(alpha, beta):
    return f"α = {alpha * 1e6:,.0f} µs, β = {beta * 1e9:.3f} ns/B ({1 / beta / 1e9:.2f} GB/s)"


def bytes_label(n):
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def table(report):
    lines = []
    for entry in report["results"]:
        world_size, found = entry["world_size"], entry["collectives"]
        lines += [
            f"\nW = {world_size} ({report['backend']}): median seconds per call (send_recv: one "
            "way)",
            "| bytes | " + " | ".join(COLLECTIVES) + " |",
            "| --- |" + " --- |" * len(COLLECTIVES),
        ]
        every = sorted({n for name in COLLECTIVES for n, _ in found[name]["points"]})
        for n in every:
            cells = [
                next((f"{t * 1e6:,.0f} µs" for m, t in found[name]["points"] if m == n), "")
                for name in COLLECTIVES
            ]
            lines.append(f"| {bytes_label(n)} | " + " | ".join(cells) + " |")
        lines.append("")
        for name in COLLECTIVES:
            lines.append(
                f"{name:>15}: t = α + n·β, "
                f"{describe(found[name]['alpha_s'], found[name]['beta_s_per_byte'])}"
            )
        model = found["all_reduce"]["ring_model"]
        lines.append(
            f"{'ring model':>15}: from send_recv, 2(W−1)·α' + 2(W−1)/W·n·β' = "
            f"{describe(model['alpha_s'], model['beta_s_per_byte'])}; measured/model: α "
            f"{model['alpha_vs_fit']:.2f}, "
            f"β {model['beta_vs_fit']:.2f}"
        )
    if report["backend"] == "gloo":
        lines.append(
            "\nNCCL (GPUs): not measured here; run with --device cuda on a machine with 2 or more "
            "GPUs."
        )
    return "\n".join(lines)


def plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5), sharex=True, sharey=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, name in zip(axes.flat, COLLECTIVES + ["ring"]):
        for colour, entry in zip(colours, report["results"]):
            world_size, found = entry["world_size"], entry["collectives"]
            target = found["all_reduce" if name == "ring" else name]
            ns = [n for n, _ in target["points"]]
            line = [min(ns), *ns] if ns else []
            if name == "ring":
                model = target["ring_model"]
                ax.plot(
                    ns,
                    [t for _, t in target["points"]],
                    "o",
                    color=colour,
                    label=f"W = {world_size}: all_reduce, measured",
                )
                ax.plot(
                    line,
                    [model["alpha_s"] + n * model["beta_s_per_byte"] for n in line],
                    "--",
                    color=colour,
                    label="ring model from send_recv: "
                    f"{describe(model['alpha_s'], model['beta_s_per_byte'])}",
                )
                continue
            ax.plot(
                ns,
                [t for _, t in target["points"]],
                "o",
                color=colour,
                label=f"W = {world_size}, measured",
            )
            ax.plot(
                line,
                [target["alpha_s"] + n * target["beta_s_per_byte"] for n in line],
                "-",
                color=colour,
                label=f"fit: {describe(target['alpha_s'], target['beta_s_per_byte'])}",
            )
        title = (
            "all_reduce against the ring model from send/recv"
            if name == "ring"
            else ("send/recv, one way (ranks 0 and 1)" if name == "send_recv" else name)
        )
        ax.set(title=title, xscale="log", yscale="log")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    for ax in axes[-1]:
        ax.set_xlabel("message size n (bytes of the whole tensor)")
    for ax in axes[:, 0]:
        ax.set_ylabel("seconds per call")
    m = report["machine"]
    note = " NCCL on GPUs: not measured (no GPU here)." if report["backend"] == "gloo" else ""
    fig.suptitle(
        f"{report['backend']} on {report['device']}: {m['cpu']}, {m['cores']} cores, torch "
        f"{m['torch']}; "
        f"median of {report['repeats']} samples × {report['rounds']} rounds.{note}\n"
        f"Fitted lines: α = the median time up to {bytes_label(SMALL)}, "
        f"β = the median of (t − α) / n from {bytes_label(LARGE)} on.",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def machine():
    import platform

    cpu = platform.processor()
    if Path("/proc/cpuinfo").exists():
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            cpu,
        )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def main():
    args = parse()
    os.environ["OMP_NUM_THREADS"] = "1"  # the spawned processes inherit it
    if args.refit:  # the saved points, fitted again; the timings are not touched
        report = json.loads(Path(args.json).read_text())
        report["results"] = [
            fitted_entry(
                entry["world_size"],
                {name: found["points"] for name, found in entry["collectives"].items()},
            )
            for entry in report["results"]
        ]
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        plot(report, args.plot)
        print(table(report))
        print(f"refitted {args.json}, drew {args.plot}")
        return
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("collectives: --device cuda needs GPUs, and torch sees none")
        args.world_sizes = [w for w in args.world_sizes if w <= torch.cuda.device_count()]
        if not args.world_sizes:
            sys.exit(
                f"collectives: {torch.cuda.device_count()} GPU(s): one process per GPU, and a "
                "collective needs 2"
            )
    backend = "nccl" if args.device == "cuda" else "gloo"
    results = []
    for world_size in args.world_sizes:
        rounds = []
        for round_ in range(args.rounds):
            print(f"{backend}, W = {world_size}: round {round_ + 1} of {args.rounds}", flush=True)
            rounds.append(sweep(world_size, args))
        results.append(analyse(world_size, rounds))
    report = {
        "backend": backend,
        "device": args.device,
        "machine": machine(),
        "repeats": args.repeats,
        "rounds": args.rounds,
        "sample_ms": args.sample_ms,
        "quick": args.quick,
        "dtype": "float32",
        "message": "n = bytes of the whole tensor: input of broadcast, all_reduce, reduce_scatter; "
        "output of all_gather",
        "results": results,
    }
    if backend == "gloo":
        report["nccl"] = (
            "not measured: this run had no GPU; python benchmarks/collectives.py --device cuda on "
            "one"
        )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.metrics:
        Path(args.metrics).write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.plot)
    print(table(report))
    print(f"wrote {args.json} and {args.plot}")


if __name__ == "__main__":
    began = time.monotonic()
    main()
    print(f"collectives: {time.monotonic() - began:.0f} s")
