"""Draw the documentation's pictures from the real PyTorch objects the training scripts use.

    python docs/figures.py              # writes docs/images/*.png and docs/images/figures.json
    # writes the same files into DIR instead (tests/test_figures.py does)
    python docs/figures.py --out DIR

Nothing in a picture is typed in by hand: four gloo processes on this machine (a few seconds, CPU
only) run the real code the training scripts run, and the pictures draw what they recorded. (When
things happen during a step, the pipeline schedules included, is drawn from measured runs by
docs/timelines.py.)

  fsdp_shards.png     which rows of each BabyCNN parameter each rank holds after fully_shard, on a
                      1-D mesh of 4 ranks (--sharding full) and a 2 x 2 (replicate, shard) mesh
                      (--sharding hybrid)
  sampler.png         the sample indices DistributedSampler hands each rank in one epoch, with
                      drop_last=True (as the scripts set it) and with drop_last=False (the default:
                      it pads by repeating)
  ring_allreduce.png  ring all-reduce on 4 ranks, simulated here step by step; the script checks
                      that the simulation's result equals a real dist.all_reduce before drawing it
  device_mesh.png     how init_device_mesh lays train_pippy.py's (pp, dp) and train_fsdp.py's
                      (replicate, shard) meshes over 2 nodes x 2 processes
  tp_pair.png         a column-wise then row-wise pair of train_tp.py on 2 TP ranks, f and g: the
                      shapes its tensor_parallel() gives BabyCNN's block 2, and what a forward
                      records going in and out of each convolution
  overlap.png         what overlap buys, as a model (not a measurement): DDP's bucket all-reduces
                      and FSDP's all-gathers and reduce-scatters beside the compute of the measured
                      CPU timelines (docs/images/timelines.json), each collective t = α + n·β from
                      the gloo fit (benchmarks/results/collectives.json); once taking turns, once
                      on a stream of its own

figures.json, written next to the PNGs, holds the exact data each picture draws.
tests/test_figures.py regenerates it and compares it with the committed one: PNG bytes differ
between matplotlib and freetype versions, the data does not. When a change to the code or to torch
changes a picture, that test fails until `python docs/figures.py` is run again and its output
committed.
"""

import argparse
import itertools
import json
import sys
import tempfile
from datetime import timedelta
from fractions import Fraction
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data.distributed import DistributedSampler

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from models import BabyCNN  # noqa: E402
from train_tp import tensor_parallel  # noqa: E402  the script's own split

TIMELINES = ROOT / "docs" / "images" / "timelines.json"  # measured compute: docs/timelines.py
COLLECTIVES = ROOT / "benchmarks" / "results" / "collectives.json"  # the α–β fits

# gloo processes: 2 pipeline ranks x 2 replicas, 4 FSDP shards, 2 nodes x 2 processes, 4 ring ranks
WORLD = 4
PIPELINE_RANKS = 2  # train_pippy.py --data-parallel 2 on 4 processes
# not a multiple of 4: drop_last=True has something to drop, drop_last=False something to pad
SAMPLES = 18
SAMPLER_PANELS = ((2, True), (4, True), (4, False))  # (ranks, drop_last)
DPI = 100
RANK_COLOURS = ["#4477aa", "#ee6677", "#228833", "#ccbb44"]  # Paul Tol's colour-blind-safe set
IDLE = "#eeeeee"
TP_BLOCK, TP_BATCH = 2, 4  # the pair drawn: block 2 (conv1 16 -> 32 channels, conv2 32 -> 32)


# --------------------------------------------------------------------------------------------------
# Part 1: what the four gloo processes record. Everything that needs a real process group happens
# here.
# --------------------------------------------------------------------------------------------------


def shard_rows(mesh, rank):
    """fully_shard BabyCNN as train_fsdp.py does (each block, then the root), then find out which
    rows of each parameter this rank holds: every rank writes its own rank number into its shard
    (to_local()) and full_tensor() all-gathers the parameter, so row i of the result says who holds
    row i."""
    model = BabyCNN(device="meta")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    parameters = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.to_local().fill_(rank)
            owner_of_row = (
                param.full_tensor().flatten(1)[:, 0] if param.dim() > 1 else param.full_tensor()
            )
            rows = [row for row, owner in enumerate(owner_of_row.tolist()) if owner == rank]
            first = rows[0] if rows else 0
            # one block of rows, all of to_local()
            if rows != list(range(first, first + param.to_local().shape[0])):
                raise AssertionError(
                    f"{name}: rank {rank} holds rows {rows}, to_local() {param.to_local().shape}"
                )
            parameters[name] = dict(
                shape=list(param.shape),
                placements=[repr(p) for p in param.placements],
                local_shape=list(param.to_local().shape),
                rows=[rows[0], rows[-1] + 1] if rows else [],
            )
    return parameters


def tp_pair(tp_mesh):
    """train_tp.py's tensor_parallel() on BabyCNN over this rank's TP group, then one forward: the
    whole and local shapes of block TP_BLOCK's two convolutions, their placements, and what goes
    into and out of each."""
    model = BabyCNN()
    tensor_parallel(model, tp_mesh)
    block, seen = model.blocks[TP_BLOCK], {}

    def record(name):
        def hook(module, inputs, output):  # returns None: the output stays as it is
            seen[name] = (list(inputs[0].shape), list(output.shape))

        return hook

    hooks = [
        getattr(block, name).register_forward_hook(record(name)) for name in ("conv1", "conv2")
    ]
    torch.manual_seed(0)  # the same images on every rank: a TP group's ranks see the same batch
    with torch.no_grad():
        model(torch.randn(TP_BATCH, 1, 28, 28))
    for hook in hooks:
        hook.remove()
    layers = {}
    for name in ("conv1", "conv2"):
        conv = getattr(block, name)
        layers[name] = dict(
            weight=list(conv.weight.shape),
            weight_local=list(conv.weight.to_local().shape),
            weight_placement=str(conv.weight.placements[0]),
            bias=list(conv.bias.shape),
            bias_local=list(conv.bias.to_local().shape),
            bias_placement=str(conv.bias.placements[0]),
            input=seen[name][0],
            output=seen[name][1],
        )
    return dict(tp_rank=tp_mesh.get_local_rank(), layers=layers)


def ring_inputs(world):
    """Rank r's tensor in the ring picture: 8 elements (4 chunks of 2), (r + 1) x [1 .. 8]."""
    return [(rank + 1) * torch.arange(1.0, 9.0) for rank in range(world)]


def worker(rank, world, init_file, result_file):
    """One of the WORLD gloo processes. Rank 0 writes what they all recorded to ``result_file``."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),  # a stuck collective fails instead of hanging
    )
    try:
        # Ranks as torchrun numbers them on 2 nodes of 2 processes: rank = node x 2 + local rank.
        pp_mesh = init_device_mesh(
            "cpu", (world // PIPELINE_RANKS, PIPELINE_RANKS), mesh_dim_names=("pp", "dp")
        )
        full_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        hybrid_mesh = init_device_mesh(
            "cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")
        )
        # train_tp.py's (dp, tp) mesh: TP groups of 2 neighbouring ranks
        tp_mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))["tp"]
        reduced = ring_inputs(world)[rank].clone()
        # the real thing the ring picture must agree with (gloo picks its own algorithm)
        dist.all_reduce(reduced)
        mine = dict(
            full=shard_rows(full_mesh, rank),
            hybrid=shard_rows(hybrid_mesh, rank),
            meshes={
                label: dict(
                    names=list(mesh.mesh_dim_names),
                    shape=list(mesh.mesh.shape),
                    coordinate=mesh.get_coordinate(),
                    groups={
                        dim: dist.get_process_group_ranks(mesh.get_group(dim))
                        for dim in mesh.mesh_dim_names
                    },
                )
                for label, mesh in (("pipeline", pp_mesh), ("hybrid", hybrid_mesh))
            },
            all_reduce=reduced.tolist(),
            tp_pair=tp_pair(tp_mesh),
        )
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            Path(result_file).write_text(json.dumps(everyone))
    finally:
        dist.destroy_process_group()


def record_in_process_group():
    """Start WORLD gloo processes and return what each recorded, by rank.

    fork, not spawn: the children start in milliseconds with torch already imported. (This process
    has run no torch op yet, so no thread pool is copied half-way.)"""
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp, "result.json")
        mp.start_processes(
            worker,
            args=(WORLD, Path(tmp, "rendezvous"), result_file),
            nprocs=WORLD,
            start_method="fork",
        )
        return json.loads(result_file.read_text())


# --------------------------------------------------------------------------------------------------
# Part 2: turn the records into the data each picture draws (this is what figures.json holds).
# --------------------------------------------------------------------------------------------------


def fsdp_data(records):
    layouts = {}
    for label, title in (
        ("full", "--sharding full: fully_shard on a 1-D mesh of 4 ranks"),
        ("hybrid", "--sharding hybrid: a (replicate 2, shard 2) mesh"),
    ):
        parameters = {}
        for name in records[0][label]:
            per_rank = [records[rank][label][name] for rank in range(len(records))]
            parameters[name] = dict(
                shape=per_rank[0]["shape"],
                placements=per_rank[0]["placements"],
                local_shapes=[p["local_shape"] for p in per_rank],
                rows=[p["rows"] for p in per_rank],
            )
        layouts[label] = dict(title=title, parameters=parameters)
    return dict(png="fsdp_shards.png", world_size=len(records), layouts=layouts)


def sampler_data():
    """What DistributedSampler gives each rank (shuffle, seed 0): with drop_last=True, as the
    scripts set it, on 2 and 4 ranks, and with drop_last=False, its default, on 4 ranks, where 18
    samples do not divide by 4."""
    # One replica gets the whole shuffled order: the permutation every rank computes from the seed
    # and epoch.
    order = list(
        DistributedSampler(
            range(SAMPLES), num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True
        )
    )
    panels = []
    for world, drop_last in SAMPLER_PANELS:
        ranks = [
            list(
                DistributedSampler(
                    range(SAMPLES),
                    num_replicas=world,
                    rank=rank,
                    shuffle=True,
                    seed=0,
                    drop_last=drop_last,
                )
            )
            for rank in range(world)
        ]
        per_rank = SAMPLES // world if drop_last else -(-SAMPLES // world)
        # drop_last=False pads the order to per_rank x world by repeating its first indices.
        dealt = (
            order[: per_rank * world] if drop_last else order + order[: per_rank * world - SAMPLES]
        )
        if any(ranks[rank] != dealt[rank::world] for rank in range(world)):  # what the picture says
            raise AssertionError(
                f"rank r does not get positions r, r+{world}, ... of {dealt}: {ranks}"
            )
        panels.append(
            dict(
                world_size=world,
                drop_last=drop_last,
                ranks=ranks,
                per_rank=per_rank,
                dropped=order[len(dealt) :],
                repeated=dealt[SAMPLES:],
            )
        )
    return dict(png="sampler.png", samples=SAMPLES, seed=0, epoch=0, order=order, panels=panels)


def ring_data(records):
    """Ring all-reduce on len(records) ranks, step by step, checked against the real
    dist.all_reduce.

    Each tensor is cut into one chunk per rank. Reduce-scatter: in step s rank r sends chunk (r - s)
    mod N to rank r + 1, which adds it to its own copy; after N - 1 steps rank r holds the whole sum
    of chunk (r + 1) mod N. All-gather: the finished chunks go round the ring the same way,
    overwriting. The simulation counts what each rank sends: 2 (N - 1) chunks of 1/N of the tensor,
    2 (N - 1) / N of it, which nears 2 but never reaches it as N grows, in 2 (N - 1) steps that each
    pay the link's latency once."""
    world = len(records)
    inputs = ring_inputs(world)
    chunks = [
        list(tensor.chunk(world)) for tensor in inputs
    ]  # chunks[rank][c]: rank's current copy of chunk c
    holders = [
        [[rank] for _ in range(world)] for rank in range(world)
    ]  # whose inputs are summed in that copy
    steps, sent = [], [0] * world  # sent[rank]: elements that rank has sent
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(world - 1):
            first = -step if phase == "reduce-scatter" else 1 - step
            sends = [
                dict(src=rank, dst=(rank + 1) % world, chunk=(rank + first) % world)
                for rank in range(world)
            ]
            steps.append(
                dict(
                    phase=phase,
                    step=step + 1,
                    sends=sends,
                    before=[[list(h) for h in held] for held in holders],
                )
            )
            outgoing = [
                (s, chunks[s["src"]][s["chunk"]].clone(), list(holders[s["src"]][s["chunk"]]))
                for s in sends
            ]
            for send, tensor, summed in outgoing:  # all sends of a step happen at once
                dst, chunk = send["dst"], send["chunk"]
                sent[send["src"]] += tensor.numel()
                if phase == "reduce-scatter":
                    chunks[dst][chunk] = chunks[dst][chunk] + tensor
                    holders[dst][chunk] = sorted(holders[dst][chunk] + summed)
                else:
                    chunks[dst][chunk], holders[dst][chunk] = tensor, summed
    result = [torch.cat(rank_chunks).tolist() for rank_chunks in chunks]
    real = [records[rank]["all_reduce"] for rank in range(world)]
    expected = sum(inputs).tolist()
    # The picture must not show wrong math: the simulation, the real collective and the plain sum
    # agree exactly.
    if not (result == real == [expected] * world):
        raise AssertionError(
            f"ring simulation {result} != dist.all_reduce {real} or the sum {expected}"
        )
    share = [Fraction(elements, inputs[0].numel()) for elements in sent]
    # what the caption says
    if share != [Fraction(2 * (world - 1), world)] * world or len(steps) != 2 * (world - 1):
        raise AssertionError(
            f"each rank sends {share} of its tensor in {len(steps)} steps, not 2(W-1)/W in 2(W-1)"
        )
    return dict(
        png="ring_allreduce.png",
        world_size=world,
        inputs=[t.tolist() for t in inputs],
        steps=steps,
        final=[[list(h) for h in held] for held in holders],
        result=result,
        all_reduce=real,
        sent_share=[[f.numerator, f.denominator] for f in share],
    )


def mesh_data(records):
    meshes = {}
    for label in ("pipeline", "hybrid"):
        meshes[label] = dict(
            names=records[0]["meshes"][label]["names"],
            shape=records[0]["meshes"][label]["shape"],
            coordinates=[records[r]["meshes"][label]["coordinate"] for r in range(len(records))],
            groups=[records[r]["meshes"][label]["groups"] for r in range(len(records))],
        )
    return dict(png="device_mesh.png", nodes=2, processes_per_node=len(records) // 2, meshes=meshes)


def tp_data(records):
    """The pair as TP group 0 (ranks 0 and 1) holds it; the other group's must be the same."""
    group = [records[0]["tp_pair"], records[1]["tp_pair"]]
    if [g["tp_rank"] for g in group] != [0, 1] or any(
        r["tp_pair"]["layers"] != group[0]["layers"] for r in records
    ):
        raise AssertionError(
            f"the TP ranks do not hold the same shapes: {[r['tp_pair'] for r in records]}"
        )
    return dict(png="tp_pair.png", tp=2, block=TP_BLOCK, batch=TP_BATCH, layers=group[0]["layers"])


def alpha_beta(fits, name):
    """(α in ms, β in ms a byte) of a collective on 2 gloo ranks."""
    entry = next(e for e in fits["results"] if e["world_size"] == 2)["collectives"][name]
    return entry["alpha_s"] * 1e3, entry["beta_s_per_byte"] * 1e3


def schedule(actions, overlap):
    """Lay out actions [(lane, label, duration_ms, needs)], in program order, on a compute and a
    comm lane.

    needs: the labels that must be done before the action starts. Compute runs in order. A
    collective is issued when the compute before it in program order has started (overlap: it runs
    beside that compute) or has ended (taking turns: nothing runs beside it); the comm lane runs one
    collective at a time, in the order issued."""
    done, placed, free = {}, [], {"compute": 0.0, "comm": 0.0}
    last_compute = None  # (start, end) of the compute action before this one in program order
    for lane, label, duration, needs in actions:
        ready = max([done[n] for n in needs], default=0.0)
        if lane == "comm":
            issued = 0.0 if last_compute is None else last_compute[0 if overlap else 1]
            start = max(ready, issued, free["comm"])
            if not overlap:
                start = max(start, free["compute"])
        else:
            start = max(ready, free["compute"])
            if not overlap:
                start = max(start, free["comm"])
            last_compute = (start, start + duration)
        placed.append(
            dict(lane=lane, label=label, start=round(start, 3), end=round(start + duration, 3))
        )
        done[label] = start + duration
        free[lane] = start + duration
    return placed


def overlap_data():
    """DDP's three buckets (bucket_cap_mb=0.05) in backward, and an FSDP step (--sharding full,
    width 8): compute from the measured timelines, collectives from the α–β fits, laid out taking
    turns and overlapped."""
    timelines, fits = json.loads(TIMELINES.read_text()), json.loads(COLLECTIVES.read_text())

    def durations(events):  # rank 0's compute actions, in ms
        return {
            name: end - start
            for name, start, end in events
            if name.startswith(("forward", "backward"))
        }

    ddp_run = timelines["ddp"]["runs"]["0.05"]
    ddp_compute = durations(ddp_run["times"]["events"][0])
    alpha, beta = alpha_beta(fits, "all_reduce")
    ready_after = {
        b["index"]: f"backward {b['parameters'][-1].rsplit('.', 2)[0]}" for b in ddp_run["buckets"]
    }
    ddp_actions = []
    for block in (3, 2, 1, 0):
        ddp_actions.append(
            ("compute", f"backward blocks.{block}", ddp_compute[f"backward blocks.{block}"], [])
        )
        for bucket in ddp_run[
            "buckets"
        ]:  # a bucket's all-reduce follows the backward that fills it
            if ready_after[bucket["index"]] == f"backward blocks.{block}":
                ddp_actions.append(
                    (
                        "comm",
                        f"all-reduce bucket {bucket['index']}",
                        alpha + bucket["bytes"] * beta,
                        [f"backward blocks.{block}"],
                    )
                )
    ddp_bytes = {f"all-reduce bucket {b['index']}": b["bytes"] for b in ddp_run["buckets"]}

    fsdp = timelines["fsdp"]
    fsdp_compute = durations(fsdp["shardings"]["full"]["times"]["events"][0])
    model = BabyCNN(width=fsdp["width"])
    block_bytes = {
        i: sum(p.numel() * p.element_size() for p in block.parameters())
        for i, block in enumerate(model.blocks)
    }
    gather, scatter = alpha_beta(fits, "all_gather"), alpha_beta(fits, "reduce_scatter")
    last = len(model.blocks) - 1

    def ag(block, again=""):
        return (
            "comm",
            f"all-gather blocks.{block}{again}",
            gather[0] + block_bytes[block] * gather[1],
            [],
        )

    fsdp_actions = [ag(0)]
    # forward: the next block's gather is issued as this block computes
    for block in range(last + 1):
        fsdp_actions.append(
            (
                "compute",
                f"forward blocks.{block}",
                fsdp_compute[f"forward blocks.{block}"],
                [f"all-gather blocks.{block}"],
            )
        )
        if block < last:
            fsdp_actions.append(ag(block + 1))
    # backward: the block (the last kept its weights), the next block's gather issued as it
    # computes, its RS
    for block in range(last, -1, -1):
        needs = [] if block == last else [f"all-gather blocks.{block} again"]
        fsdp_actions.append(
            ("compute", f"backward blocks.{block}", fsdp_compute[f"backward blocks.{block}"], needs)
        )
        if block > 0:
            fsdp_actions.append(ag(block - 1, " again"))
        fsdp_actions.append(
            (
                "comm",
                f"reduce-scatter blocks.{block}",
                scatter[0] + block_bytes[block] * scatter[1],
                [f"backward blocks.{block}"],
            )
        )
    fsdp_bytes = {
        label: block_bytes[int(label.split("blocks.")[1].split()[0])]
        for _, label, _, _ in fsdp_actions
        if not label.startswith(("forward", "backward"))
    }

    panels = {}
    for key, title, actions, sizes, fit in (
        (
            "ddp",
            "DDP, bucket_cap_mb=0.05: backward and its three bucket all-reduces (2 ranks)",
            ddp_actions,
            ddp_bytes,
            {"all_reduce": [alpha, beta]},
        ),
        (
            "fsdp",
            f"FSDP --sharding full, width {fsdp['width']}: a whole step (2 ranks)",
            fsdp_actions,
            fsdp_bytes,
            {"all_gather": list(gather), "reduce_scatter": list(scatter)},
        ),
    ):
        runs = {
            mode: schedule(actions, overlap=mode == "overlapped")
            for mode in ("taking turns", "overlapped")
        }
        panels[key] = dict(
            title=title,
            bytes=sizes,
            fit_ms=fit,
            runs=runs,
            step_ms={mode: max(a["end"] for a in run) for mode, run in runs.items()},
        )
    return dict(png="overlap.png", model=True, panels=panels)


# --------------------------------------------------------------------------------------------------
# Part 3: draw. Each function draws only from its part of figures.json.
# --------------------------------------------------------------------------------------------------


def lighter(colour, amount):
    """``colour`` mixed with ``amount`` of white."""
    r, g, b = to_rgb(colour)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def ink(face):
    """Black text on a light face, white on a dark one."""
    r, g, b = to_rgb(face)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.6 else "white"


def frame(fig, title, note, top=0.75, bottom=0.45, left=0.2, right=0.2, **spacing):
    """A bold title and a small note at the top, margins in inches. A fixed layout rather than
    tight_layout, which draws the whole figure once more just to measure it (a third of the drawing
    time here)."""
    width, height = fig.get_size_inches()
    fig.text(0.1 / width, 1 - 0.1 / height, title, fontsize=12, fontweight="bold", va="top")
    fig.text(0.1 / width, 1 - 0.4 / height, note, fontsize=9, va="top", linespacing=1.4)
    fig.subplots_adjust(
        left=left / width,
        right=1 - right / width,
        top=1 - top / height,
        bottom=bottom / height,
        **spacing,
    )


def figure(size, rows=1, columns=1, **options):
    """A figure and its axes, drawn by Agg into files. No pyplot: no display, no global state to
    clean up."""
    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, columns, **options)


def save(fig, path):
    # Fixed size and dpi, no "Software" tag (it names the matplotlib version): the same data, the
    # same bytes on one matplotlib and freetype.
    fig.savefig(path, dpi=DPI, metadata={"Software": None})


def draw_fsdp(data, path):
    layouts = data["layouts"]
    fig, axes = figure((16, 7.6), 1, len(layouts), sharey=True)
    for ax, layout in zip(axes, layouts.values()):
        names = list(layout["parameters"])
        for y, name in enumerate(names):
            p = layout["parameters"][name]
            n = p["shape"][0]
            # Ranks holding the same rows are replicas of one shard: draw them in lanes, one above
            # the other.
            holders = {}
            for rank, rows in enumerate(p["rows"]):
                if rows:
                    holders.setdefault(tuple(rows), []).append(rank)
            for (start, stop), ranks in holders.items():
                height = 0.8 / len(ranks)
                for lane, rank in enumerate(ranks):
                    bottom = y - 0.4 + lane * height
                    ax.add_patch(
                        Rectangle(
                            (start / n, bottom),
                            (stop - start) / n,
                            height,
                            facecolor=RANK_COLOURS[rank],
                            edgecolor="white",
                            linewidth=1.5,
                        )
                    )
                    rows_text = f"{start}–{stop - 1}" if stop - start > 1 else f"{start}"
                    ax.text(
                        (start + stop) / 2 / n,
                        bottom + height / 2,
                        f"r{rank}: {rows_text}",
                        ha="center",
                        va="center",
                        fontsize=7.5 if len(ranks) == 1 else 6.5,
                        color=ink(RANK_COLOURS[rank]),
                    )
            ax.text(
                1.015,
                y,
                f"{' / '.join(str(shape[0]) for shape in p['local_shapes'])}",
                va="center",
                fontsize=8,
                transform=ax.get_yaxis_transform(),
            )
        ax.set_yticks(
            range(len(names)),
            [
                f"{name}  {'×'.join(map(str, layout['parameters'][name]['shape']))}"
                for name in names
            ],
            fontsize=8,
        )
        ax.set_ylim(len(names) - 0.5, -0.5)
        ax.set_xlim(0, 1)
        ax.set_xticks([0, 0.25, 0.5, 0.75, 1], ["0", "¼", "½", "¾", "all"])
        ax.set_xlabel(
            "rows (dim 0) of the parameter. In a bar, r1: 2–3 = rank 1 holds rows 2 to 3;\n"
            "right of it, the rows each rank holds, rank 0 / 1 / 2 / 3",
            fontsize=9,
        )
        placements = sorted({", ".join(p["placements"]) for p in layout["parameters"].values()})
        ax.set_title(
            f"{layout['title']}\nevery parameter a DTensor, placements ({'; '.join(placements)})",
            fontsize=10,
        )
    frame(
        fig,
        f"FSDP2: which rows of each BabyCNN parameter each of {data['world_size']} ranks holds "
        "after "
        "fully_shard (each block, then the root, as train_fsdp.py does)",
        "Every rank wrote its rank number into its shard (param.to_local()), and full_tensor() "
        "gathered the "
        "shards back: row i of the result names its holder. Dim 0 is cut like torch.chunk, "
        "ceil(rows / ranks) "
        "each,\nso blocks.3.fc's 10 rows split 3 / 3 / 3 / 1. In the hybrid mesh ranks 0 and 2 "
        "hold the same "
        "rows (replicas, one per node), and so do ranks 1 and 3.",
        top=1.25,
        bottom=0.75,
        left=2.5,
        right=1.3,
        wspace=0.22,
    )
    save(fig, path)


def sampler_cell(ax, x, y, label, face, repeated=False):
    """A sample in one position; a repeated one (drop_last=False's padding) pale, with a dashed
    border."""
    face = lighter(face, 0.55) if repeated else face
    ax.add_patch(
        Rectangle(
            (x + 0.05, y - 0.4),
            0.9,
            0.8,
            facecolor=face,
            edgecolor="black" if repeated else "none",
            linestyle="--",
            linewidth=1.2,
        )
    )
    ax.text(
        x + 0.5,
        y,
        str(label),
        ha="center",
        va="center",
        fontsize=9,
        color="#888888" if face == IDLE else ink(face),
    )


def draw_sampler(data, path):
    panels = data["panels"]
    n = data["samples"]
    fig, axes = figure(
        (13, 0.55 * sum(2 + p["world_size"] for p in panels) + 1.5),
        len(panels),
        1,
        height_ratios=[1 + p["world_size"] for p in panels],
    )
    for ax, p in zip(axes, panels):
        world = p["world_size"]
        dealt = data["order"] + p["repeated"]  # the positions the ranks are dealt from
        for position, sample in enumerate(dealt):
            face = RANK_COLOURS[position % world] if position < p["per_rank"] * world else IDLE
            sampler_cell(ax, position, 0, sample, face, repeated=position >= n)
        for rank, samples in enumerate(p["ranks"]):
            for k, sample in enumerate(samples):
                sampler_cell(
                    ax,
                    rank + k * world,
                    rank + 1,
                    sample,
                    RANK_COLOURS[rank],
                    repeated=rank + k * world >= n,
                )
            ax.text(len(dealt) + 0.3, rank + 1, f"= {samples}", va="center", fontsize=9)
        ax.set_yticks(
            range(world + 1), ["epoch order"] + [f"rank {r}" for r in range(world)], fontsize=9
        )
        ax.set_xticks([q + 0.5 for q in range(len(dealt))], range(len(dealt)), fontsize=8)
        ax.set_xlim(0, n + 8)
        ax.set_ylim(world + 0.6, -0.6)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        if p["dropped"]:
            rest = f"positions {n - len(p['dropped'])}–{n - 1} dropped (grey)"
        elif p["repeated"]:
            rest = (
                f"padded to {len(dealt)} by repeating the first {len(p['repeated'])} indices "
                "(dashed): "
                f"samples {' and '.join(map(str, p['repeated']))} are seen twice this epoch"
            )
        else:
            rest = f"{n} divides by {world}: nothing dropped or added"
        ax.set_title(
            f"{world} ranks, drop_last={p['drop_last']}: {p['per_rank']} samples each; {rest}",
            loc="left",
            fontsize=10,
        )
    axes[-1].set_xlabel(
        "position in the epoch's shuffled order (the numbers in the cells are sample indices)"
    )
    frame(
        fig,
        f"DistributedSampler over {n} samples (shuffle=True, seed={data['seed']}, epoch "
        f"{data['epoch']}): "
        "each rank's share",
        "Every rank draws the same permutation from seed + epoch (set_epoch changes it each epoch) "
        "and takes "
        "every W-th entry from position r, so every rank gets the same count.\nWhen W does not "
        "divide the "
        "samples, drop_last=True (the scripts' setting) leaves the last positions to no rank; "
        "drop_last=False "
        "(the default) pads the order with its\nfirst indices instead, so a few samples count "
        "twice.",
        top=1.25,
        bottom=0.55,
        left=1.0,
        right=0.1,
        hspace=0.35,
    )
    save(fig, path)


def draw_ring(data, path):
    world = data["world_size"]
    steps = len(data["steps"])
    numerator, denominator = data["sent_share"][0]
    share = f"{numerator}/{denominator} = {numerator / denominator:g}"
    rows = data["steps"] + [dict(phase="result", step=0, sends=[], before=data["final"])]
    fig, ax = figure((14, 0.95 * len(rows) + 1.5))
    colours = colormaps["Blues"]
    group_width = world + 1.5  # one rank's chunks, then a gap
    for y, row in enumerate(rows):
        sent = {s["src"]: s for s in row["sends"]}
        for rank in range(world):
            x0 = rank * group_width
            for chunk in range(world):
                summed = row["before"][rank][chunk]
                face = colours(0.15 + 0.8 * (len(summed) - 1) / (world - 1))
                sending = rank in sent and sent[rank]["chunk"] == chunk
                ax.add_patch(
                    Rectangle(
                        (x0 + chunk + 0.05, y - 0.3),
                        0.9,
                        0.6,
                        facecolor=face,
                        edgecolor="black" if sending else "white",
                        linewidth=2.5 if sending else 1,
                    )
                )
                label = "all" if len(summed) == world else "+".join(map(str, summed))
                ax.text(
                    x0 + chunk + 0.5,
                    y,
                    label,
                    ha="center",
                    va="center",
                    fontsize=8,
                    color=ink(face),
                )
            if rank in sent:
                s = sent[rank]
                verb = "adds it" if row["phase"] == "reduce-scatter" else "copies it"
                ax.text(
                    x0 + world / 2,
                    y + 0.45,
                    f"sends c{s['chunk']} → rank {s['dst']}, which {verb}",
                    ha="center",
                    va="center",
                    fontsize=8,
                )
        label = (
            "result"
            if row["phase"] == "result"
            else f"{row['phase']}\nstep {row['step']} of {world - 1}"
        )
        ax.text(-0.3, y, label, ha="right", va="center", fontsize=9)
    for rank in range(world):
        ax.text(
            rank * group_width + world / 2,
            -0.65,
            f"rank {rank}:  chunks c0 … c{world - 1}",
            ha="center",
            fontsize=10,
            fontweight="bold",
        )
    ax.set_xlim(-3.2, world * group_width)
    ax.set_ylim(len(rows) - 0.4, -1.0)
    ax.axis("off")
    frame(
        fig,
        f"Ring all-reduce on {world} ranks, each tensor cut in {world} chunks: {world - 1} "
        "reduce-scatter "
        f"steps, then {world - 1} all-gather steps",
        "A cell lists the ranks whose inputs that rank's copy of the chunk sums so far. Each row "
        "is the state "
        "before its step; the outlined chunk is the one the rank sends to the next rank on the "
        "ring.\n"
        f"Every rank sends {steps} chunks of 1/{world}: {share} of its tensor, 2(W−1)/W, which "
        "nears 2 as W grows; "
        f"and the {steps} = 2(W−1) steps each pay the link's latency α, so n bytes cost about "
        "2(W−1)·α + 2(W−1)/W·n·β\n(β: seconds per byte), a latency term that grows with W. "
        f"Checked against a real dist.all_reduce (gloo): {data['result'][0]} on every rank.",
        top=1.25,
        bottom=0.1,
        left=0.1,
        right=0.1,
    )
    save(fig, path)


def draw_mesh(data, path):
    nodes, per_node = data["nodes"], data["processes_per_node"]
    fig, axes = figure((13, 4.8), 1, len(data["meshes"]))
    captions = {
        "pipeline": "train_pippy.py --data-parallel 2: init_device_mesh(..., (2, 2), ('pp', 'dp'))",
        "hybrid": "train_fsdp.py --sharding hybrid: init_device_mesh(..., (2, 2), ('replicate', "
        "'shard'))",
    }
    # a rank's box, and the distance between boxes
    width, height, step_x, step_y = 1.5, 1.0, 2.6, 2.0

    def centre(rank):
        node, local = divmod(rank, per_node)
        return local * step_x + width / 2, node * step_y + height / 2

    for ax, (label, mesh) in zip(axes, data["meshes"].items()):
        for rank, coordinate in enumerate(mesh["coordinates"]):
            x, y = centre(rank)
            ax.add_patch(
                Rectangle(
                    (x - width / 2, y - height / 2),
                    width,
                    height,
                    facecolor=RANK_COLOURS[rank],
                    edgecolor="none",
                )
            )
            ax.text(
                x,
                y,
                f"rank {rank}\n"
                + ", ".join(f"{name} {c}" for name, c in zip(mesh["names"], coordinate)),
                ha="center",
                va="center",
                color=ink(RANK_COLOURS[rank]),
                fontsize=10,
            )
        # Each mesh dimension's process groups, as the mesh made them: a line from box to box
        # through the gap.
        for dim in mesh["names"]:
            for group in sorted({tuple(g[dim]) for g in mesh["groups"]}):
                for a, b in itertools.pairwise(group):
                    (xa, ya), (xb, yb) = centre(a), centre(b)
                    if ya == yb:  # same node: across the gap between columns
                        xs, ys = (xa + width / 2, xb - width / 2), (ya, yb)
                        ax.text(
                            sum(xs) / 2,
                            ya - 0.12,
                            f"{dim} group\n{list(group)}",
                            ha="center",
                            va="bottom",
                            fontsize=8.5,
                        )
                    else:  # across nodes: through the gap between rows
                        xs, ys = (xa, xb), (ya + height / 2, yb - height / 2)
                        # the label away from the panel's edge
                        inward = 1 if xa < per_node * step_x / 2 else -1
                        ax.text(
                            xa + 0.08 * inward,
                            sum(ys) / 2,
                            f"{dim} group {list(group)}",
                            va="center",
                            ha="left" if inward > 0 else "right",
                            fontsize=8.5,
                        )
                    ax.plot(xs, ys, color="black", linewidth=2)
        ax.set_xlim(-0.1, (per_node - 1) * step_x + width + 0.1)
        ax.set_ylim((nodes - 1) * step_y + height + 0.1, -0.1)
        ax.set_xticks(
            [centre(local)[0] for local in range(per_node)],
            [f"local rank {x}" for x in range(per_node)],
        )
        ax.set_yticks(
            [centre(node * per_node)[1] for node in range(nodes)],
            [f"node {y}" for y in range(nodes)],
        )
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_title(captions[label], fontsize=9.5)
    frame(
        fig,
        f"Device meshes on {nodes} nodes x {per_node} processes (torchrun numbers rank = node x "
        f"{per_node} "
        "+ local rank)",
        "Lines join the ranks of one process group. Pipeline: a stage's replicas (dp) share a "
        "node, so the "
        "gradient all-reduce of every step stays on the fast links;\nonly activations cross nodes. "
        "Hybrid FSDP: "
        "shards within a node (all-gathers every step), replicas across nodes (one all-reduce of "
        "shards).",
        top=1.15,
        bottom=0.45,
        left=0.7,
        right=0.2,
        wspace=0.3,
    )
    save(fig, path)


def box(ax, x, y, width, height, text, face, fontsize=9, **options):
    ax.add_patch(
        Rectangle((x, y), width, height, facecolor=face, edgecolor="black", linewidth=1, **options)
    )
    ax.text(
        x + width / 2,
        y + height / 2,
        text,
        ha="center",
        va="center",
        fontsize=fontsize,
        color=ink(face),
    )


def arrow(ax, start, end, text="", **options):
    ax.annotate(
        "", xy=end, xytext=start, arrowprops=dict(arrowstyle="->", linewidth=1.2, **options)
    )
    if text:
        ax.text(
            (start[0] + end[0]) / 2,
            (start[1] + end[1]) / 2 - 0.12,
            text,
            ha="center",
            va="bottom",
            fontsize=8,
        )


def draw_tp(data, path):
    conv1, conv2 = data["layers"]["conv1"], data["layers"]["conv2"]
    fig, ax = figure((14, 5.6))

    def shape(s):
        return "×".join(map(str, s))

    collective = "#ccbb44"
    for rank in range(data["tp"]):
        y = 2.3 - 2.3 * rank  # rank 0 on top
        colour = RANK_COLOURS[rank]
        ax.text(
            -0.35,
            y + 0.4,
            f"rank {rank}",
            ha="right",
            va="center",
            fontsize=11,
            fontweight="bold",
            color=colour,
        )
        box(ax, 0, y, 1.6, 0.8, f"x, whole\n{shape(conv1['input'])}", lighter(colour, 0.7))
        box(ax, 2.1, y, 0.7, 0.8, "f", collective, fontsize=12)
        lo, hi = rank * conv1["weight_local"][0], (rank + 1) * conv1["weight_local"][0]
        box(
            ax,
            3.3,
            y,
            2.2,
            0.8,
            f"conv1, column-wise\nweight {shape(conv1['weight_local'])}\n"
            f"out channels {lo}–{hi - 1}, {conv1['weight_placement']}",
            colour,
        )
        box(ax, 6.0, y, 1.7, 0.8, f"its channels\n{shape(conv1['output'])}", lighter(colour, 0.7))
        box(
            ax,
            8.2,
            y,
            2.2,
            0.8,
            f"conv2, row-wise\nweight {shape(conv2['weight_local'])}\n"
            f"in channels {lo}–{hi - 1}, {conv2['weight_placement']}",
            colour,
        )
        box(ax, 10.9, y, 1.7, 0.8, f"partial sum\n{shape(conv2['output'])}", lighter(colour, 0.7))
        for a, b in ((1.6, 2.1), (2.8, 3.3), (5.5, 6.0), (7.7, 8.2), (10.4, 10.9)):
            arrow(ax, (a, y + 0.4), (b, y + 0.4))
    box(ax, 13.1, 0.2, 0.9, 2.5, "g", collective, fontsize=12)
    for y in (2.7, 0.4):
        arrow(ax, (12.6, y), (13.1, 1.45))
    box(
        ax,
        14.5,
        0.85,
        1.9,
        1.2,
        f"+ bias {shape(conv2['bias'])}\n({conv2['bias_placement']})\n"
        f"= y, whole\n{shape(conv2['output'])}",
        "#dddddd",
    )
    arrow(ax, (14.0, 1.45), (14.5, 1.45))
    ax.text(
        2.45,
        -0.55,
        "f: forward, the identity (x is whole on each rank);\nbackward, an all-reduce of x's "
        "gradient",
        ha="center",
        va="top",
        fontsize=9,
    )
    ax.text(
        13.55,
        -0.55,
        "g: forward, an all-reduce that sums the partial outputs;\nbackward, the identity",
        ha="center",
        va="top",
        fontsize=9,
    )
    ax.text(
        6.85,
        1.45,
        "nothing between the pair: each rank's channels are what its conv2 needs",
        ha="center",
        va="center",
        fontsize=9,
        style="italic",
    )
    ax.set_xlim(-1.3, 16.6)
    ax.set_ylim(-1.3, 3.3)
    ax.axis("off")
    frame(
        fig,
        f"Tensor parallelism in train_tp.py: block {data['block']}'s pair on {data['tp']} ranks, "
        f"conv1 split column-wise, then conv2 row-wise",
        f"Shapes as train_tp.py's tensor_parallel() leaves them, and as a forward of "
        f"{data['batch']} images records them (batch × channels × height × width). Whole weights: "
        f"conv1 {shape(conv1['weight'])}, conv2 {shape(conv2['weight'])}.\nOne all-reduce in "
        "forward (g) and one in backward (f) for the pair; the "
        "row-wise bias, whole on each rank, is added once, after the sum.",
        top=1.0,
        bottom=0.1,
        left=0.1,
        right=0.1,
    )
    save(fig, path)


def draw_overlap(data, path):
    panels = data["panels"]
    fig, axes = figure((14, 7.2), len(panels), 1)
    compute, comm = "#4477aa", "#ee6677"
    for ax, (key, panel) in zip(axes, panels.items()):
        modes = list(panel["runs"])
        longest = max(panel["step_ms"].values())
        for m, mode in enumerate(modes):
            for action in panel["runs"][mode]:
                y = 3 * m + (0 if action["lane"] == "compute" else 1)
                face = compute if action["lane"] == "compute" else comm
                width = action["end"] - action["start"]
                ax.add_patch(
                    Rectangle(
                        (action["start"], y - 0.4), width, 0.8, facecolor=face, edgecolor="white"
                    )
                )
                short = (
                    action["label"]
                    .replace("blocks.", "")
                    .replace("backward ", "B")
                    .replace("forward ", "F")
                )
                short = (
                    short.replace("all-gather ", "AG")
                    .replace("reduce-scatter ", "RS")
                    .replace(" again", "")
                )
                short = short.replace("all-reduce bucket ", "AR")
                if width > longest / 60:
                    ax.text(
                        action["start"] + width / 2,
                        y,
                        short,
                        ha="center",
                        va="center",
                        fontsize=7.5,
                        color="white",
                    )
            step = panel["step_ms"][mode]
            ax.text(
                step + longest / 150, 3 * m + 0.5, f"{mode}: {step:.1f} ms", va="center", fontsize=9
            )
        saved = panel["step_ms"][modes[0]] - panel["step_ms"][modes[1]]
        ax.set_yticks(
            [0, 1, 3, 4], ["compute", "collectives", "compute", "collectives"], fontsize=8
        )
        ax.set_ylim(4.7, -0.7)
        ax.set_xlim(0, longest * 1.22)
        ax.set_xlabel(
            "ms from the first action (a model: compute measured, collectives computed)",
            fontsize=8.5,
        )
        ax.set_title(
            f"{panel['title']}: overlap saves {saved:.1f} ms of {panel['step_ms'][modes[0]]:.1f}",
            fontsize=9.5,
            loc="left",
        )
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    frame(
        fig,
        "What overlap buys: a model, not a measurement",
        "Compute: rank 0's actions in the measured CPU timelines (docs/images/timelines.json). "
        "Each collective: t = α + n·β with gloo's fit on 2 ranks "
        "(benchmarks/results/collectives.json). Top of each panel: taking turns,\nas on a CPU; "
        "below: each collective on a stream of its own, as NCCL's run on a GPU, issued as the "
        "compute before it starts (FSDP's prefetch) or as its bucket fills (DDP).",
        top=1.05,
        bottom=0.55,
        left=0.95,
        right=0.2,
        hspace=0.55,
    )
    save(fig, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "images",
        help="directory for the PNGs and figures.json (default: docs/images)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    # first: no torch op may run in this process before the fork
    records = record_in_process_group()
    torch.set_num_threads(1)
    figures = dict(
        fsdp_shards=fsdp_data(records),
        sampler=sampler_data(),
        ring_allreduce=ring_data(records),
        device_mesh=mesh_data(records),
        tp_pair=tp_data(records),
        overlap=overlap_data(),
    )
    drawers = dict(
        fsdp_shards=draw_fsdp,
        sampler=draw_sampler,
        ring_allreduce=draw_ring,
        device_mesh=draw_mesh,
        tp_pair=draw_tp,
        overlap=draw_overlap,
    )
    for key, data in figures.items():
        drawers[key](data, args.out / data["png"])
    (args.out / "figures.json").write_text(json.dumps(figures, indent=1) + "\n")
    print(f"wrote {', '.join(d['png'] for d in figures.values())} and figures.json to {args.out}")


if __name__ == "__main__":
    main()
