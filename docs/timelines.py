"""Draw when things happen in one training step, from a real 2-rank run on this machine.

    python docs/timelines.py  # writes docs/images/timeline_*.png and docs/images/timelines.json
    # writes the same files into DIR instead (tests/test_timelines.py does)
    python docs/timelines.py --out DIR

Two gloo processes (CPU, one thread each, a few seconds) build the models as the training scripts
build them, run real steps and record, on the clock both processes share (time.perf_counter_ns,
CLOCK_MONOTONIC), when each piece of work started and ended. Nothing is placed by hand; each picture
draws the median step of those recorded.

  timeline_ddp.png       one DDP step of BabyCNN (train_ddp.py's wrapping, batch 64 per rank): each
                         block's forward and backward (module hooks), and each bucket's all-reduce
                         (a DDP comm hook that starts the all-reduce and notes the time its future
                         completes); with DDP's default buckets and with bucket_cap_mb=0.05
  timeline_fsdp.png      one FSDP2 step (train_fsdp.py's wrapping: fully_shard per block, then the
                         root) with --sharding full and grad-op: FSDP's own profiler ranges
                         (FSDP::all_gather, FSDP::post_backward_reduce, ...) and the bytes the
                         process allocated during the step (torch.profiler with profile_memory=True:
                         every CPU allocation and free, with its size)
  timeline_pipeline.png  one schedule.step() of every schedule train_pippy.py's --schedule offers,
                         on 2 pipeline ranks and 4 microbatches: each forward, backward, input- and
                         weight-gradient action of each stage, at the times it ran

timelines.json, written next to the PNGs, holds what the pictures draw. Under each key named "times"
are the measurements: they change from run to run and are drawn, never compared. Everything else is
structure: the order of the events on each rank, which collective follows which block, the buckets
and what they hold, which all-gathers run in backward, how many bytes more grad-op holds after
forward. tests/test_timelines.py runs this script again and compares that structure with the
committed file.
"""

import argparse
import json
import os
import re
import sys
import tempfile
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

# the profiler's own log: without it, an "ERROR" line on GPU-less hosts
os.environ.setdefault("KINETO_LOG_LEVEL", "5")
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from matplotlib.patches import Patch, Rectangle
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from figures import IDLE, figure, frame, ink, lighter, save  # noqa: E402  the look of docs/figures.py

from models import BabyCNN  # noqa: E402
from train_pippy import SCHEDULES, Stage, balanced_stages, block_flops  # noqa: E402  the --schedule names and their classes, as the script maps them

WORLD = 2
# steps run before recording (DDP rebuilds its buckets after the first), steps recorded
WARMUP, RECORDED = 2, 3
DDP_BATCH = 64  # train_ddp.py's default --batch-size, width 1
# DDP's default buckets (25 MiB, the first 1 MiB) hold all 172 kB of BabyCNN's gradients at once:
# one all-reduce after the whole backward. 0.05 MiB cuts them into three, so the first all-reduces
# can run during the backward.
DDP_RUNS = {"default": None, "0.05": 0.05}
# FSDP at --width 8 --batch-size 8: 1.86 M parameters, so that the gathered weights weigh about as
# much as the activations and the memory curve shows them (at width 1 and batch 64 the activations
# weigh 45 times the weights).
FSDP_WIDTH, FSDP_BATCH = 8, 8
SHARDINGS = ("full", "grad-op")
# train_pippy.py --batch-size 256 --microbatches 4: 64 samples a microbatch, so that each action
# computes for milliseconds, longer than a message between the ranks takes on gloo
PIPELINE_BATCH, MICROBATCHES = 256, 4
BLOCKS = 4
ACTION = re.compile(r"(\d+)([FBIW])(\d+)")  # torch's notation: 2F0 = stage 2, forward, microbatch 0
STAGE_COLOURS = ["#4477aa", "#ee7733", "#228833", "#aa3377"]
BLOCK_COLOURS = [
    "#4477aa",
    "#66ccee",
    "#228833",
    "#ccbb44",
]  # Paul Tol's colour-blind-safe set, one per block
COMM_COLOUR, GATHER_COLOUR = "#ee6677", "#aa3377"  # all-reduce and reduce-scatter; all-gather


def now():
    return time.perf_counter_ns()


# --------------------------------------------------------------------------------------------------
# Part 1: what the two gloo processes record. Everything that needs a real process group happens
# here.
# --------------------------------------------------------------------------------------------------


def ddp_steps(bucket_cap_mb):
    """Train BabyCNN under DDP as train_ddp.py wraps it; record WARMUP + RECORDED steps, return the
    RECORDED.

    Each step: [(label, start ns, end ns)], labels "forward blocks.i", "backward blocks.i",
    "all-reduce bucket k", "optimizer step", "step"; and the buckets: [(index, parameter names,
    bytes)]."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = BabyCNN()
    names = {id(p): name for name, p in model.named_parameters()}
    ddp_model = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=bucket_cap_mb)
    # train_ddp.py's
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    events, started, buckets = [], {}, {}

    def begin(label):
        started[label] = now()

    def end(label):
        events.append((label, started.pop(label), now()))

    backward_ends = {}
    for index, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda module, args, i=index: begin(f"forward blocks.{i}"))
        block.register_forward_hook(
            lambda module, args, output, i=index: end(f"forward blocks.{i}")
        )
        # Backward of a block: from the gradient of its output (the pre-hook) to its last
        # parameter's gradient.
        block.register_full_backward_pre_hook(
            lambda module, grad, i=index: begin(f"backward blocks.{i}")
        )
        for param in block.parameters():
            param.register_post_accumulate_grad_hook(
                lambda p, i=index: backward_ends.__setitem__(i, now())
            )

    def timed_allreduce(state, bucket):
        """What DDP does without a hook (divide by the world size, all-reduce), noting when it
        starts and ends."""
        start = now()
        index, tensor = bucket.index(), bucket.buffer()
        buckets[index] = (
            [names[id(p)] for p in bucket.parameters()],
            tensor.numel() * tensor.element_size(),
        )
        future = dist.all_reduce(tensor.div_(world), async_op=True).get_future()

        def finished(future):
            events.append((f"all-reduce bucket {index}", start, now()))
            return future.value()[0]

        return future.then(finished)

    ddp_model.register_comm_hook(None, timed_allreduce)
    # random images: the timing, not the learning
    generator = torch.Generator().manual_seed(dist.get_rank())
    images = torch.randn(DDP_BATCH, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (DDP_BATCH,), generator=generator)
    steps = []
    for step in range(WARMUP + RECORDED):
        optimizer.zero_grad(set_to_none=True)
        events.clear()
        backward_ends.clear()
        # both ranks start the step together, as the previous step's all-reduce leaves them
        dist.barrier()
        step_start = now()
        loss = F.cross_entropy(ddp_model(images), labels)
        loss.backward()  # returns once every bucket's all-reduce has finished
        # close each block's backward at its last gradient
        for index, finished in backward_ends.items():
            events.append(
                (f"backward blocks.{index}", started.pop(f"backward blocks.{index}"), finished)
            )
        begin("optimizer step")
        optimizer.step()
        end("optimizer step")
        events.append(("step", step_start, now()))
        if step >= WARMUP:
            steps.append(sorted(events, key=lambda e: (e[1], e[2])))
    return dict(steps=steps, buckets=[[k, *buckets[k]] for k in sorted(buckets)])


def fsdp_steps(sharding, mesh):
    """Train BabyCNN under FSDP2 as train_fsdp.py wraps it; profile RECORDED steps after WARMUP.

    Returns, per recorded step, FSDP's own profiler ranges and our markers as (name, start ns, end
    ns) and the allocations as (time ns, bytes: + allocated, - freed, made by the training thread),
    on the perf_counter_ns clock, and the bytes of the gathered weights FSDP held at the end of
    forward. The others come from gloo's own thread: buffers of its collectives, freed when that
    thread gets to it."""
    torch.manual_seed(0)
    model = BabyCNN(width=FSDP_WIDTH, device="meta")
    reshard = sharding != "grad-op"
    last_block = len(model.blocks) - 1
    for index, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard and index != last_block)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    model.to_empty(device="cpu")
    model.reset_parameters()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    generator = torch.Generator().manual_seed(dist.get_rank())
    images = torch.randn(FSDP_BATCH, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (FSDP_BATCH,), generator=generator)

    gathered = []  # per profiled step: bytes of the whole (gathered, not DTensor) weights held

    def step(profiled):
        # before the step's range: the gradients' memory is the last step's
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        with record_function("step") if profiled else nullcontext():
            with record_function("forward") if profiled else nullcontext():
                loss = F.cross_entropy(model(images), labels)
            if profiled:
                weights = [p for p in model.parameters() if not isinstance(p, DTensor)]
                gathered.append(sum(p.numel() * p.element_size() for p in weights))
            with record_function("backward") if profiled else nullcontext():
                loss.backward()
            with record_function("optimizer step") if profiled else nullcontext():
                optimizer.step()

    for _ in range(WARMUP):
        step(False)
    # Before the profiler starts: the first step the profiler sees then frees no gradient it did not
    # see allocated.
    optimizer.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        clock = now()
        with record_function("clock"):  # ties the profiler's clock to perf_counter_ns
            pass
        for _ in range(RECORDED):
            step(True)
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(str(Path(tmp, "trace.json")))
        trace = json.loads(Path(tmp, "trace.json").read_text())["traceEvents"]
    marker = next(e for e in trace if e.get("name") == "clock" and e.get("ph") == "X")
    to_ns = lambda us: round((us - marker["ts"]) * 1000) + clock  # noqa: E731  profiler µs -> perf_counter ns
    ranges = sorted(
        (
            (e["name"], to_ns(e["ts"]), to_ns(e["ts"] + e["dur"]))
            for e in trace
            if e.get("ph") == "X"
            and (
                e["name"].startswith("FSDP::")
                or e["name"] in ("step", "forward", "backward", "optimizer step")
            )
        ),
        key=lambda r: (r[1], r[2]),
    )
    allocations = sorted(
        (to_ns(e["ts"]), e["args"]["Bytes"], e["tid"] == marker["tid"])
        for e in trace
        if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0  # 0: the CPU
    )
    steps = []
    for k, (_, start, end) in enumerate([r for r in ranges if r[0] == "step"]):
        steps.append(
            dict(
                ranges=[r for r in ranges if start <= r[1] <= end],
                allocations=[a for a in allocations if start <= a[0] <= end],
                gathered_after_forward=gathered[k],
            )
        )
    return steps


def timed_actions(stage, log):
    """Note the start and end of every compute call the schedule makes on ``stage``, named in
    torch's notation: 2F0 is stage 2's forward of microbatch 0, B a full backward, I its
    input-gradient half, W its weight half."""
    forward, backward, weight = (
        stage.forward_one_chunk,
        stage.backward_one_chunk,
        stage.backward_weight_one_chunk,
    )

    def timed(name, call, *args, **kwargs):
        start = now()
        result = call(*args, **kwargs)
        log.append((name, start, now()))
        return result

    def forward_one_chunk(fwd_chunk_id, *args, **kwargs):
        return timed(f"{stage.stage_index}F{fwd_chunk_id}", forward, fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        return timed(
            f"{stage.stage_index}{'B' if full_backward else 'I'}{bwd_chunk_id}",
            backward,
            bwd_chunk_id,
            loss=loss,
            full_backward=full_backward,
            last_backward=last_backward,
        )

    def backward_weight_one_chunk(bwd_chunk_id, last_backward=False):
        return timed(
            f"{stage.stage_index}W{bwd_chunk_id}", weight, bwd_chunk_id, last_backward=last_backward
        )

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


def pipeline_steps():
    """Every schedule of train_pippy.py's SCHEDULES, built as train_pippy.py builds it on 2 pipeline
    ranks: {name: (stage indices on this rank, the blocks of every stage,
            [per recorded step: (step start, end, [(action, start, end)])])}."""
    rank = dist.get_rank()
    # the same batch on both ranks: only the first stage reads it
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(PIPELINE_BATCH, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (PIPELINE_BATCH,), generator=generator)
    results = {}
    for name, (schedule_class, stages_kind) in SCHEDULES.items():
        # train_pippy.py's default --stages-per-rank
        stages_per_rank = 1 if stages_kind == "one" else 2
        num_stages = WORLD * stages_per_rank
        # The same placement as train_pippy.py: loop (stage s on rank s % ranks), or a V for zbv.
        if name == "zbv":
            stage_indices = [rank, 2 * WORLD - 1 - rank]
        else:
            stage_indices = [rank + k * WORLD for k in range(stages_per_rank)]
        torch.manual_seed(0)
        model = BabyCNN()
        # as train_pippy.py splits
        stage_blocks = balanced_stages(block_flops(model, images[:1]), num_stages)
        log, stages = [], []
        for stage_index in stage_indices:
            # fp32
            stage_model = Stage(
                [model.blocks[block] for block in stage_blocks[stage_index]], nullcontext()
            )
            stages.append(PipelineStage(stage_model, stage_index, num_stages, torch.device("cpu")))
            timed_actions(stages[-1], log)
        schedule = schedule_class(
            stages[0] if stages_kind == "one" else stages,
            n_microbatches=MICROBATCHES,
            loss_fn=F.cross_entropy,
            scale_grads=False,
        )
        recorded = []
        # the first step sets up the stages' buffers and links: not recorded
        for step in range(1 + RECORDED):
            model.zero_grad(set_to_none=True)
            log.clear()
            dist.barrier()
            start = now()
            # inputs: first stage only
            schedule.step(*([images] if 0 in stage_indices else []), target=labels)
            if step:
                recorded.append((start, now(), list(log)))
        results[name] = (stage_indices, stage_blocks, recorded)
    return results


def worker(rank, world, init_file, result_file):
    """One of the two gloo processes. Rank 0 writes what both recorded to ``result_file``."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),  # a stuck collective fails instead of hanging
    )
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        mine = dict(
            ddp={label: ddp_steps(cap) for label, cap in DDP_RUNS.items()},
            fsdp={sharding: fsdp_steps(sharding, mesh) for sharding in SHARDINGS},
            pipeline=pipeline_steps(),
        )
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            Path(result_file).write_text(json.dumps(everyone))
    finally:
        dist.destroy_process_group()


def record_in_process_group():
    """Start WORLD gloo processes and return what each recorded, by rank (fork: see
    docs/figures.py)."""
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
# Part 2: turn the records into the data each picture draws (timelines.json): structure, and
# "times".
# --------------------------------------------------------------------------------------------------


def median_step(per_rank_steps, bounds):
    """The index of the step whose duration (first start to last end over the ranks) is the
    median."""
    durations = []
    for k in range(len(per_rank_steps[0])):
        starts, ends = zip(*(bounds(steps[k]) for steps in per_rank_steps))
        durations.append(max(ends) - min(starts))
    return sorted(range(len(durations)), key=durations.__getitem__)[len(durations) // 2]


def ms(t, origin):
    return round((t - origin) / 1e6, 3)


def covered(events, prefix, start, end):
    """Milliseconds of [start, end] during which at least one event named prefix... ran (their
    union)."""
    spans = sorted((max(s, start), min(e, end)) for name, s, e in events if name.startswith(prefix))
    total, reached = 0.0, start
    for s, e in spans:
        if e > max(s, reached):
            total += e - max(s, reached)
            reached = e
    return round(total, 3)


def ddp_data(records):
    runs = {}
    for label, cap in DDP_RUNS.items():
        per_rank = [records[rank]["ddp"][label] for rank in range(WORLD)]
        buckets = per_rank[0]["buckets"]
        if any(r["buckets"] != buckets for r in per_rank):
            raise AssertionError(
                f"the ranks' DDP buckets differ: {[r['buckets'] for r in per_rank]}"
            )
        steps = [r["steps"] for r in per_rank]
        k = median_step(
            steps, lambda events: next((s, e) for name, s, e in events if name == "step")
        )
        chosen = [s[k] for s in steps]
        origin = min(s for events in chosen for name, s, _ in events if name == "step")
        order = [[name for name, _, _ in events if name != "step"] for events in chosen]
        times = [
            [[name, ms(s, origin), ms(e, origin)] for name, s, e in events] for events in chosen
        ]
        backward_end = [max(e for name, _, e in t if name.startswith("backward")) for t in times]
        runs[label] = dict(
            bucket_cap_mb=cap,
            buckets=[
                dict(index=index, parameters=params, bytes=size) for index, params, size in buckets
            ],
            order=order,  # per rank, by start time
            # An all-reduce starts before the first block's backward (the backward's last part)
            # begins.
            overlaps_backward=[
                o.index("all-reduce bucket 0") < o.index("backward blocks.0") for o in order
            ],
            times=dict(
                events=times,
                backward_end=backward_end,
                in_flight_during_backward_ms=[
                    covered(t, "all-reduce", 0, backward_end[r]) for r, t in enumerate(times)
                ],
                exposed_ms=[
                    round(
                        max([e for name, _, e in t if name.startswith("all-reduce")])
                        - backward_end[r],
                        3,
                    )
                    for r, t in enumerate(times)
                ],
            ),
        )
    return dict(png="timeline_ddp.png", world_size=WORLD, batch_size=DDP_BATCH, runs=runs)


def fsdp_label(name):
    """FSDP's profiler range names -> what the picture calls them (None: not drawn)."""
    for prefix, label in (
        ("FSDP::all_gather (", "all-gather"),
        ("FSDP::post_backward_reduce (", "reduce-scatter"),
    ):
        if name.startswith(prefix):
            return f"{label} {name[len(prefix) : -1]}"
    return None


def fsdp_events(step):
    """(label, start, end) of the compute and the collectives of one rank's step, from FSDP's
    ranges: a block's forward runs from the end of its FSDP::pre_forward to the start of its
    FSDP::post_forward, its backward from the end of its FSDP::pre_backward to the start of its
    FSDP::post_backward_accumulate (torch 2.15 has no such range: there, to the start of its
    FSDP::post_backward_reshard, which comes first)."""
    ranges = step["ranges"]

    def find(name):
        return next(((s, e) for n, s, e in ranges if n == name), None)

    events = []
    for i in range(BLOCKS):
        block = f"blocks.{i}"
        events.append(
            (
                f"forward {block}",
                find(f"FSDP::pre_forward ({block})")[1],
                find(f"FSDP::post_forward ({block})")[0],
            )
        )
        backward_end = find(f"FSDP::post_backward_accumulate ({block})") or find(
            f"FSDP::post_backward_reshard ({block})"
        )
        events.append(
            (f"backward {block}", find(f"FSDP::pre_backward ({block})")[1], backward_end[0])
        )
    events += [(fsdp_label(n), s, e) for n, s, e in ranges if fsdp_label(n)]
    events.append(("optimizer step", *find("optimizer step")))
    return sorted(events, key=lambda e: (e[1], e[2])), find("step"), find("forward")


def memory_curve(step, origin, forward_end):
    """The bytes allocated since the step began: (curve, bytes at the end of forward, peak bytes).

    The curve is [[ms, MiB]], the highest level in each 0.1 ms with a change (a step plot of it
    keeps every peak). At the end of forward only the training thread's allocations count: gloo's
    thread frees its buffers when it gets the CPU, on a loaded machine a few milliseconds late, and
    what is held then would depend on that."""
    level, levels = 0, []
    for t, size, _ in step["allocations"]:
        level += size
        levels.append((t, level))
    binned = {}
    for t, level in levels:
        key = round(ms(t, origin), 1)
        binned[key] = max(binned.get(key, level), level)
    curve = [[0.0, 0.0]] + [[t, round(level / 2**20, 3)] for t, level in sorted(binned.items())]
    after_forward = sum(
        size for t, size, training in step["allocations"] if training and t <= forward_end
    )
    return curve, after_forward, max(level for _, level in levels)


def fsdp_data(records):
    shardings = {}
    for sharding in SHARDINGS:
        steps = [records[rank]["fsdp"][sharding] for rank in range(WORLD)]
        k = median_step(
            steps, lambda step: next((s, e) for n, s, e in step["ranges"] if n == "step")
        )
        parsed = [fsdp_events(s[k]) for s in steps]
        origin = min(step_range[0] for _, step_range, _ in parsed)
        order, collectives, times, curves, after_forward, peaks = [], [], [], [], [], []
        gathered = [s[k]["gathered_after_forward"] for s in steps]
        for rank, (events, _, forward) in enumerate(parsed):
            order.append([name for name, _, _ in events])
            collectives.append(
                {
                    phase: [
                        name
                        for name, s, _ in events
                        if name.startswith(("all-gather", "reduce-"))
                        and (s < forward[1]) == (phase == "forward")
                    ]
                    for phase in ("forward", "backward")
                }
            )
            times.append([[name, ms(s, origin), ms(e, origin)] for name, s, e in events])
            curve, held, peak = memory_curve(steps[rank][k], origin, forward[1])
            curves.append(curve)
            after_forward.append(held)
            peaks.append(round(peak / 2**20, 3))
        shardings[sharding] = dict(
            order=order,
            collectives=collectives,
            all_gathers_in_backward=[
                [name.split()[-1] for name in c["backward"] if name.startswith("all-gather")]
                for c in collectives
            ],
            gathered_after_forward_bytes=gathered,
            times=dict(
                events=times,
                forward_end=[ms(forward[1], origin) for _, _, forward in parsed],
                memory=curves,
                after_forward_mib=[round(b / 2**20, 3) for b in after_forward],
                peak_mib=peaks,
            ),
        )
    # Not a matter of timing: at the end of forward grad-op still holds every block's gathered
    # weights, full only the last block's (whose backward comes next). Counted from the weights
    # FSDP holds, not from the allocations: which thread frees a collective's buffer, and when, is
    # a race (a CI run once counted block 3's all-gather buffer as held). The peaks, in backward,
    # lie too close to order them: the picture shows them, nothing checks them.
    held = {s: shardings[s].pop("gathered_after_forward_bytes") for s in SHARDINGS}
    return dict(
        png="timeline_fsdp.png",
        world_size=WORLD,
        width=FSDP_WIDTH,
        batch_size=FSDP_BATCH,
        parameters=sum(p.numel() for p in BabyCNN(width=FSDP_WIDTH, device="meta").parameters()),
        shardings=shardings,
        grad_op_holds_more_after_forward_bytes=[
            g - f for f, g in zip(held["full"], held["grad-op"])
        ],
    )


def pipeline_data(records):
    schedules = {}
    for name, (schedule_class, _) in SCHEDULES.items():
        per_rank = [records[rank]["pipeline"][name] for rank in range(WORLD)]
        steps = [recorded for _, _, recorded in per_rank]
        k = median_step(steps, lambda step: (step[0], step[1]))
        chosen = [s[k] for s in steps]
        origin = min(start for start, _, _ in chosen)
        ran = [[action for action, _, _ in log] for _, _, log in chosen]
        if any(sorted(log, key=lambda a: a[1]) != log for _, _, log in chosen):
            raise AssertionError(f"{name}: actions overlap on one rank")
        busy = [sum(e - s for _, s, e in log) for _, _, log in chosen]
        length = max(end for _, end, _ in chosen) - origin
        schedules[name] = dict(
            schedule_class=schedule_class.__name__,
            stages=[indices for indices, _, _ in per_rank],
            stage_blocks=per_rank[0][1],
            ran=ran,
            times=dict(
                actions=[
                    [[ms(s, origin), ms(e, origin)] for _, s, e in log] for _, _, log in chosen
                ],
                step_ms=[ms(end, origin) for _, end, _ in chosen],
                step_length_ms=round(length / 1e6, 3),
                idle_fraction=[round(1 - b / length, 3) for b in busy],
            ),
        )
    return dict(
        png="timeline_pipeline.png",
        pipeline_ranks=WORLD,
        batch_size=PIPELINE_BATCH,
        microbatches=MICROBATCHES,
        schedules=schedules,
    )


# --------------------------------------------------------------------------------------------------
# Part 3: draw. Each function draws only from its part of timelines.json.
# --------------------------------------------------------------------------------------------------


def block_of(label):
    return int(label.rsplit(".", 1)[1]) if "blocks." in label else None


def bar(ax, start, end, y, face, char, texts=(), edge=None, height=0.7, hatch=None, fontsize=7.5):
    """A box from start to end, with the first of ``texts`` that fits in it (``char``: a letter's
    width, in ms)."""
    ax.add_patch(
        Rectangle(
            (start, y - height / 2),
            end - start,
            height,
            facecolor=face,
            edgecolor=edge or face,
            linewidth=0.8,
            hatch=hatch,
        )
    )
    text = next((t for t in texts if (len(t) + 0.5) * char <= end - start), None)
    if text:
        ax.text(
            (start + end) / 2, y, text, ha="center", va="center", fontsize=fontsize, color=ink(face)
        )


def compute_face(label):
    colour = BLOCK_COLOURS[block_of(label)] if block_of(label) is not None else "#999999"
    return colour if label.startswith("forward") else lighter(colour, 0.5)


def texts(label):
    """What a box may say, longest first: forward blocks.2 -> F2, all-reduce bucket 1 -> bucket 1,
    b1, ..."""
    kind, _, what = label.partition(" ")
    if kind in ("forward", "backward"):
        return (f"{kind[0].upper()}{block_of(label)}",)
    if kind == "all-reduce":
        return what, f"b{what.split()[-1]}"
    if kind in ("all-gather", "reduce-scatter"):
        return (f"{'AG' if kind == 'all-gather' else 'RS'}{block_of(label)}",)
    return ("opt",)  # the optimizer step


def draw_lanes(ax, events_per_rank, char, title, sublanes=1):
    """Two lanes per rank: its compute, then its collectives; events_per_rank: [[label, start, end]]
    per rank. With sublanes=n, all-reduce bucket k gets row k of n in the collectives' lane: buckets
    in flight together."""
    ticks, names = [], []
    for rank, events in enumerate(events_per_rank):
        y_compute, y_comm = 2.4 * rank, 2.4 * rank + 1
        for label, start, end in events:
            if label.startswith("all-reduce"):
                k, height = int(label.split()[-1]), 0.8 / sublanes
                bar(
                    ax,
                    start,
                    end,
                    y_comm - 0.4 + (k + 0.5) * height,
                    COMM_COLOUR,
                    char,
                    texts(label),
                    edge="white",
                    height=height,
                )
            elif label.startswith(("all-", "reduce-")):
                bar(
                    ax,
                    start,
                    end,
                    y_comm,
                    GATHER_COLOUR if "gather" in label else COMM_COLOUR,
                    char,
                    texts(label),
                )
            else:
                bar(ax, start, end, y_compute, compute_face(label), char, texts(label))
        ticks += [y_compute, y_comm]
        names += [f"rank {rank}: compute", f"rank {rank}: collectives"]
    ax.set_yticks(ticks, names, fontsize=8.5)
    ax.set_ylim(2.4 * len(events_per_rank) - 0.9, -0.6)
    ax.set_title(title, loc="left", fontsize=10)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="y", length=0)


def draw_ddp(data, path):
    runs = data["runs"]
    fig, axes = figure((14, 2.6 * len(runs) + 2.0), len(runs), 1, sharex=True)
    horizon = max(
        e for run in runs.values() for events in run["times"]["events"] for _, _, e in events
    )
    for ax, run in zip(axes, runs.values()):
        sizes = ", ".join(f"{b['bytes'] / 1000:.1f} kB" for b in run["buckets"])
        cap = (
            "DDP's default buckets (25 MiB, the first 1 MiB)"
            if run["bucket_cap_mb"] is None
            else f"bucket_cap_mb={run['bucket_cap_mb']}"
        )
        in_flight = " and ".join(f"{t:.1f}" for t in run["times"]["in_flight_during_backward_ms"])
        exposed = " and ".join(f"{t:.1f}" for t in run["times"]["exposed_ms"])
        draw_lanes(
            ax,
            [[e for e in events if e[0] != "step"] for events in run["times"]["events"]],
            horizon / 200,
            f"{cap}: {len(run['buckets'])} bucket{'s' if len(run['buckets']) > 1 else ''} "
            f"({sizes}). "
            f"All-reduce in flight during backward: {in_flight} ms; after it: {exposed} ms (ranks "
            "0 and 1)",
            sublanes=len(run["buckets"]),
        )
        for rank, end in enumerate(run["times"]["backward_end"]):
            ax.plot(
                [end, end],
                [2.4 * rank - 0.5, 2.4 * rank + 1.5],
                color="black",
                linewidth=1,
                linestyle=":",
            )
    axes[-1].set_xlim(0, horizon * 1.01)
    axes[-1].set_xlabel(
        "milliseconds since the step began (both ranks on one clock); dotted: the rank's backward "
        "has computed its last gradient"
    )
    handles = [
        Patch(
            facecolor=BLOCK_COLOURS[i],
            label=f"F{i}, B{i}: forward (dark), backward (light) of blocks.{i}",
        )
        for i in range(BLOCKS)
    ]
    handles += [
        Patch(facecolor="#999999", label="opt: optimizer step"),
        Patch(facecolor=COMM_COLOUR, label="bucket k (bk): its all-reduce, start to end"),
    ]
    fig.legend(
        handles=handles,
        loc="lower center",
        ncol=3,
        fontsize=8.5,
        frameon=False,
        bbox_to_anchor=(0.5, 0.0),
    )
    frame(
        fig,
        f"One DDP step of BabyCNN on {data['world_size']} ranks (gloo, CPU, batch "
        f"{data['batch_size']} per "
        "rank), measured: when each bucket's all-reduce runs",
        "Backward runs from the last block to the first (B3 first). A bucket's all-reduce starts "
        "when its last "
        "gradient is ready and ends when both ranks have sent it: one that starts\nbefore the "
        "dotted line "
        "overlaps the backward. Forward and backward: module hooks; all-reduce: a DDP comm hook. "
        "The median of "
        f"{RECORDED} measured steps.",
        top=1.05,
        bottom=1.15,
        left=1.6,
        right=0.2,
        hspace=0.45,
    )
    save(fig, path)


def draw_fsdp(data, path):
    shardings = data["shardings"]
    fig, axes = figure(
        (14, 9.5), 2 * len(shardings), 1, sharex=True, height_ratios=[1.6, 1.0] * len(shardings)
    )
    horizon = max(
        e for s in shardings.values() for events in s["times"]["events"] for _, _, e in events
    )
    for row, (sharding, s) in enumerate(shardings.items()):
        ax, mem = axes[2 * row], axes[2 * row + 1]
        gathered = (
            ", ".join(b.replace("blocks.", "") for b in s["all_gathers_in_backward"][0]) or "none"
        )
        draw_lanes(
            ax,
            s["times"]["events"],
            horizon / 200,
            f"--sharding {sharding}: all-gathers in backward (blocks): {gathered}",
        )
        for rank, curve in enumerate(s["times"]["memory"]):
            t, mib = zip(*curve)
            colour = ["#4477aa", "#ee6677"][rank]
            mem.plot(
                t,
                mib,
                color=colour,
                linewidth=1.2,
                drawstyle="steps-post",
                label=f"rank {rank}: {s['times']['after_forward_mib'][rank]:.1f} MiB at the end of "
                "forward "
                f"(dotted); highest {s['times']['peak_mib'][rank]:.1f} MiB, gloo's buffers "
                "included",
            )
            end = s["times"]["forward_end"][rank]
            mem.plot(
                [end, end],
                [0, s["times"]["peak_mib"][rank]],
                color=colour,
                linewidth=1,
                linestyle=":",
            )
        mem.set_ylabel("MiB allocated\nsince step start", fontsize=8)
        mem.set_ylim(0, 1.5 * max(s["times"]["peak_mib"]))  # room for the legend above the curves
        mem.legend(fontsize=8, loc="upper center", frameon=False, ncol=2)
        for side in ("top", "right"):
            mem.spines[side].set_visible(False)
    axes[-1].set_xlim(0, horizon * 1.01)
    axes[-1].set_xlabel("milliseconds since the step began (both ranks on one clock)")
    handles = [
        Patch(facecolor=BLOCK_COLOURS[i], label=f"F{i}, B{i}: blocks.{i}") for i in range(BLOCKS)
    ]
    handles += [
        Patch(facecolor=GATHER_COLOUR, label="AGi: all-gather of block i's weights"),
        Patch(facecolor=COMM_COLOUR, label="RSi: reduce-scatter of block i's gradients"),
        Patch(facecolor="#999999", label="opt: optimizer step"),
    ]
    fig.legend(
        handles=handles,
        loc="lower center",
        ncol=4,
        fontsize=8.5,
        frameon=False,
        bbox_to_anchor=(0.5, 0.0),
    )
    frame(
        fig,
        f"One FSDP2 step of BabyCNN --width {data['width']} ({data['parameters']:,} parameters) on "
        f"{data['world_size']} ranks (gloo, CPU, batch {data['batch_size']} per rank), measured",
        "Compute and collectives from FSDP's own profiler ranges; memory: every CPU allocation and "
        "free the "
        "profiler saw during the step (profile_memory=True), above what the rank held before "
        "it\n(its shards and "
        "optimizer state). full gathers blocks 0-2 again in backward; grad-op keeps them from "
        "forward. "
        f"The median of {RECORDED} measured steps.\nOn a CPU, FSDP waits for each collective it "
        "calls (no second "
        "stream to run it on), so compute and collectives take turns. The highest level includes "
        "buffers that "
        "gloo's thread frees late,\nso it moves from run to run.",
        top=1.4,
        bottom=1.15,
        left=1.6,
        right=0.2,
        hspace=0.5,
    )
    save(fig, path)


def draw_pipeline(data, path):
    schedules = data["schedules"]
    horizon = max(s["times"]["step_length_ms"] for s in schedules.values())
    fig, axes = figure((14, 1.45 * len(schedules) + 2.0), len(schedules), 1, sharex=True)
    for ax, (name, s) in zip(axes, schedules.items()):
        for rank, (ran, spans) in enumerate(zip(s["ran"], s["times"]["actions"])):
            ax.add_patch(
                Rectangle(
                    (0, rank - 0.38),
                    s["times"]["step_ms"][rank],
                    0.76,
                    facecolor=IDLE,
                    edgecolor="none",
                )
            )
            for action, (start, end) in zip(ran, spans):
                stage, kind, microbatch = ACTION.fullmatch(action).groups()
                colour = STAGE_COLOURS[int(stage)]
                face = colour if kind == "F" else lighter(colour, 0.45 if kind in "BI" else 0.75)
                bar(
                    ax,
                    start,
                    end,
                    rank,
                    face,
                    horizon / 220,
                    (f"{kind}{microbatch}", kind),
                    edge=colour,
                    height=0.76,
                    hatch="///" if kind == "W" else None,
                    fontsize=7,
                )
        per_rank = len(s["stages"][0])
        idle = ", ".join(f"{100 * f:.0f}%" for f in s["times"]["idle_fraction"])
        ax.set_title(
            f"{name}: {s['schedule_class']}, {per_rank} stage{'s' if per_rank > 1 else ''} per "
            "rank — "
            f"step {s['times']['step_length_ms']:.1f} ms, idle per rank {idle}",
            loc="left",
            fontsize=10,
        )
        ax.set_yticks(
            range(len(s["ran"])),
            [
                f"rank {r}\nstage{'s' if len(st) > 1 else ''} {', '.join(map(str, st))}"
                for r, st in enumerate(s["stages"])
            ],
            fontsize=8.5,
        )
        ax.set_ylim(len(s["ran"]) - 0.5, -0.5)
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
        ax.tick_params(axis="y", length=0)
    axes[-1].set_xlim(0, horizon * 1.01)
    axes[-1].set_xlabel("milliseconds since schedule.step() began (both ranks on one clock)")
    handles = [Patch(facecolor=c, label=f"stage {i}") for i, c in enumerate(STAGE_COLOURS)]
    handles += [
        Patch(
            facecolor=IDLE,
            label="idle: waiting for another rank, sending or receiving (the bubble)",
        )
    ]
    fig.legend(
        handles=handles,
        loc="lower center",
        ncol=5,
        fontsize=9,
        frameon=False,
        bbox_to_anchor=(0.5, 0.0),
    )
    frame(
        fig,
        f"Pipeline schedules on {data['pipeline_ranks']} ranks, {data['microbatches']} "
        "microbatches of "
        f"{data['batch_size'] // data['microbatches']} samples (train_pippy.py --schedule NAME "
        "--batch-size "
        f"{data['batch_size']} --microbatches {data['microbatches']}), measured",
        "Each action at the time it ran in one real schedule.step() (the median of "
        f"{RECORDED}). F forward (dark), B full backward (light), I input-gradient half of a "
        "backward (light), "
        "W weight-gradient half (hatched);\nthe number is the microbatch, the colour the stage. "
        "Grey: the rank "
        "computes nothing.",
        top=1.2,
        bottom=0.85,
        left=0.85,
        right=0.15,
        hspace=0.6,
    )
    save(fig, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "images",
        help="directory for the PNGs and timelines.json (default: docs/images)",
    )
    args = parser.parse_args()
    # as docs/figures.py: the committed pictures were drawn with torch 2.14
    if torch.__version__ < (2, 14):
        sys.exit(
            f"error: on torch {torch.__version__}, zbv cannot run on gloo (its schedule sends "
            "between a rank's own neighbouring stages, and gloo cannot send to its own rank): "
            "draw the timelines with a later torch"
        )
    args.out.mkdir(parents=True, exist_ok=True)

    # first: no torch op may run in this process before the fork
    records = record_in_process_group()
    torch.set_num_threads(1)
    timelines = dict(
        ddp=ddp_data(records), fsdp=fsdp_data(records), pipeline=pipeline_data(records)
    )
    for key, draw in dict(ddp=draw_ddp, fsdp=draw_fsdp, pipeline=draw_pipeline).items():
        draw(timelines[key], args.out / timelines[key]["png"])
    (args.out / "timelines.json").write_text(json.dumps(timelines, indent=1) + "\n")
    print(
        f"wrote {', '.join(d['png'] for d in timelines.values())} and timelines.json to {args.out}"
    )


if __name__ == "__main__":
    main()
