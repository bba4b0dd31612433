"""Train a model with pipeline parallelism (torch.distributed.pipelining): a rank runs some blocks.

Launch (the README and run_pippy.sh use the same commands):
    python train_pippy.py                                     # one process: one stage, no pipeline
    torchrun --standalone --nproc-per-node=2 train_pippy.py   # one node, 2 stages
    torchrun --nnodes=2 --node-rank=$NODE_RANK --nproc-per-node=2 --rdzv-backend=c10d \
        --rdzv-endpoint=$MASTER_ADDR:29500 --rdzv-id=babycnn train_pippy.py # on each node
Through the wrapper: `bash run_pippy.sh [flags]`; for two nodes, on each node,
`NNODES=2 NODE_RANK=0|1 MASTER_ADDR=node0 MASTER_PORT=29500 bash run_pippy.sh [flags]`.

What pipeline parallelism changes compared with train_ddp.py:
  model  built on meta; model.blocks is cut into stages of about equal FLOPs, and a
         rank allocates and fills only its stages' blocks (the others become nn.Identity)
  layout a device mesh: pipeline ranks x data-parallel replicas (--data-parallel D; by
         default as many pipeline ranks as the blocks fit, the rest replicas)
  wrap   a PipelineStage per local stage; a schedule (GPipe, 1F1B, ...) runs the
         microbatches through all of them
  loop   schedule.step(): the first stage feeds inputs, the last computes the loss
         (the one logged); then all-reduces sum a tied weight's copies on two stages
         and, with D > 1, average each stage's gradients over its replicas (as DDP)
  save   rank 0 gathers every stage's weights and writes one plain state dict
Every collective is called here, or in a call marked "collective".
"""

import collections
import functools
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.utils.data.distributed import DistributedSampler
from torch.utils.flop_counter import FlopCounterMode

import models
from models import data
from plumbing import failures, outputs, parts, training, watch
from plumbing.training import START
from plumbing.watch import log

# name: (schedule class, stages per rank it runs)
SCHEDULES = {
    "gpipe": (ScheduleGPipe, "one"),
    "1f1b": (Schedule1F1B, "one"),
    "interleaved-1f1b": (ScheduleInterleaved1F1B, "several"),
    "looped-bfs": (ScheduleLoopedBFS, "several"),
    "interleaved-zb": (ScheduleInterleavedZeroBubble, "several"),
    "zbv": (ScheduleZBVZeroBubble, "two, in a V"),
}
if torch.__version__ < (2, 14):  # three workarounds for older releases' stages
    from plumbing.older_pipeline import OlderPipelineStage as PipelineStage  # noqa: F811


def main():
    parser = training.parser(__doc__.splitlines()[0], data.add_arguments)
    add_arguments(parser)
    args = parser.parse_args()

    # ---- setup: one process per device, all of them in one process group ----
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # picks the device
    device = training.pick_device(args, local_rank)
    # Before the process group: no collective's timeout runs during a download.
    found = data.find(args.dataset, args.data_dir, download=not args.no_download, model=args.model)
    backend = dist.get_default_backend_for_device(device)  # NCCL or gloo
    dist.init_process_group(backend, **failures.process_group_options(device))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dtype, autocast = training.dtype_of(args), training.autocast(args, device)

    # ---- data: the same data set on every rank ----
    # collective: all ranks train on the same data
    dataset_name, train_set, test_set = data.load(found, device, dtype, args.workers, log)
    test_batches = training.Batches(test_set, args.batch_size, device, dtype, args.workers)

    # ---- model: its parameters on meta (no memory) until each rank fills its stages' blocks ----
    torch.manual_seed(args.seed)
    with parts.parameters_on_meta():
        model = models.build(args, train_set, device, dtype)  # --model, for the data
    if not (fill := parts.filled_by(model, args)):  # nothing fills a part: whole, as train_ddp.py
        model = models.build(args, train_set, device, dtype)  # --model, for the data
    param_count = sum(p.numel() for p in model.parameters())

    # ---- layout: the pipeline ranks model.blocks fit, the other ranks its replicas ----
    mesh, chosen = make_mesh(args, device, world_size, blocks_of(model))  # (pp, dp); how chosen
    dp, dp_rank = mesh["dp"].size(), mesh.get_local_rank("dp")  # replicas; this one
    # Every stage of replica d walks shard d; drop_last: no samples repeated to pad
    sampler = DistributedSampler(train_set, dp, dp_rank, seed=args.seed, drop_last=True)
    plan = training.Plan(args, len(sampler), dp, dataset_name, "replicas")
    outputs.check(args)  # collective: fails now, not after training
    if checkpointing := args.checkpoint_dir or args.resume_from:  # opt-in: imported only then
        from plumbing import checkpoint_dir
    checkpoints = checkpoint_dir.Checkpoints(args, plan, device) if checkpointing else None
    seed = hash((args.seed, dp_rank))  # for this replica's DataLoader workers
    train_batches = training.Batches(train_set, args.batch_size, device, dtype, args.workers, seed)
    training.check_data_fits(model, train_batches, test_batches)  # bad data: one line, now
    flops = watch.flops_per_sample(model, parts.on(model, next(test_batches([0]))[0]))

    # ---- wrap: a PipelineStage per local stage, its blocks filled (collective); one schedule ----
    sample = next(test_batches([0]))[0][:1]  # one input, as the first stage gets it
    stages, stage_blocks, tied = build_stages(model, args, sample, mesh, fill, autocast)
    schedule = make_schedule(stages, args, dtype)
    optimizer = training.make_optimizer(args, model.parameters())
    torch.manual_seed(args.seed + rank)  # dropout: no two ranks mask the same blocks and samples

    # ---- resume: from the newest checkpoint, if any (collective) ----
    resumed = checkpoints.resume(model, optimizer, log, tied) if checkpoints else START
    what = f"pipeline ({args.schedule}, {len(stage_blocks)} stages: blocks {stage_blocks}, "
    what += f"{args.microbatches} microbatches) x {dp} replica(s){chosen} on {world_size} rank(s)"
    figures = watch.describe(args, plan, param_count, flops, "replica")
    log(f"{what} ({backend}, {device.type}): {figures}; {parts.BUILT[fill]}")

    # ---- train loop ----
    progress = watch.Progress(plan, args, device, resumed["step"])  # --log-dir, --profile-steps
    window = []  # micro-step losses since the last log, on the device
    stop = failures.StopSignals(resumed["step"])  # records signals as they come
    norm = None  # the gradients' norm (--max-grad-norm)
    skip = resumed["samples_into_epoch"] // plan.global_batch_size  # done this epoch
    for epoch in range(resumed["epoch"], plan.epochs):
        sampler.set_epoch(epoch)  # a new shuffle, the same on every rank
        model.train()
        progress.start_epoch(epoch)
        first, skip = skip, 0
        last = min(plan.steps_per_epoch, first + plan.total_steps - progress.step)
        batches = train_batches(list(sampler)[first * plan.samples_per_step :])
        for step_in_epoch in range(first, last):
            optimizer.zero_grad(set_to_none=True)
            for micro_step in range(args.grad_accum):
                images, labels = next(batches)
                # collective: activations and gradients between stages; 0 off the last
                window.append(forward_backward(schedule, stages, images, labels, args.grad_accum))
            sum_tied_grads(tied, device, mesh.get_group("pp"))  # collective: tied weights' copies
            average_over_replicas(model, mesh.get_group("dp"))  # collective: its stages' grads
            if args.max_grad_norm:  # collective: the whole model's norm
                norm = clip_grad_norm(model, tied, args.max_grad_norm, mesh.get_group("pp"), device)
            lr = plan.lr(progress.step)
            training.set_lr(optimizer, lr)
            optimizer.step()
            progress.count_step()
            log_now = progress.is_logging_step(end_of_epoch=step_in_epoch == last - 1)
            # collective, about once a second: the ranks agree on a stop
            stop_signal = stop.agree_now(progress.step, log_now, device)
            if log_now or stop_signal:  # the last stages' losses, all-reduced
                window_loss = torch.stack(window).sum()
                dist.all_reduce(window_loss)
                mean_loss = window_loss.item() / (len(window) * dp)
                outputs.refuse_divergence(progress.step, mean_loss, checkpoints)
                progress.record_loss(mean_loss, "loss (last stage)", lr, norm)
                window.clear()
            progress.after_step()  # --profile-steps
            if checkpoints and checkpoints.is_due(progress.step, now=stop_signal):
                for buffer in model.buffers():  # replica 0's statistics are saved
                    dist.broadcast(buffer, group=mesh.get_group("dp"), group_src=0)
                # collective; refuses what is not finite
                checkpoints.save(progress.step, epoch, step_in_epoch + 1, model, optimizer, window)
            if stop_signal and progress.step < plan.total_steps:  # the last step just ends
                raise stop.stopped(progress.step, plan.total_steps, args.checkpoint_dir)

        # ---- evaluate: each replica scores a slice; the sums are all-reduced ----
        if not args.no_eval:
            test_loss, test_accuracy = evaluate(model, schedule, stages, test_batches, mesh)
            progress.record_test(test_loss, test_accuracy)
    progress.close()

    # ---- save: rank 0 gathers replica 0's stages and writes ----
    if args.save:
        full_state = gather_state_dict(model, mesh, tied)  # collective
        outputs.save_on_rank_0(full_state, args.save)  # collective
        log(f"saved the weights to {args.save}")
    if hasattr(train_set, "vocabulary"):  # text: rank 0 prints a sample (a collective gather)
        log(models.sample(model, gather_state_dict(model, mesh, tied), train_set.vocabulary))
    if args.metrics:  # collective: rank 0 gathers each rank's memory
        from plumbing import metrics

        run = {"strategy": "pipeline", "schedule": args.schedule, "stages": len(stage_blocks)}
        run |= {"microbatches": args.microbatches, "data_parallel": args.data_parallel}
        here = [stage.stage_index for stage in stages]  # this rank's stages and their blocks
        run["rank_info"] = {"stages": here, "blocks": [stage_blocks[i] for i in here]}
        metrics.write(args, plan, progress, model, optimizer, flops, param_count, **run)


def evaluate(model, schedule, stages, test_batches, mesh):
    """Collective: the test loss and accuracy over every replica's slice, forward only."""
    for buffer in model.buffers():  # BatchNorm's: replica 0's, as saved
        dist.broadcast(buffer, group=mesh.get_group("dp"), group_src=0)
    model.eval()
    first = any(stage.is_first for stage in stages)
    last = any(stage.is_last for stage in stages)

    def pipeline_forward(images, labels):  # logits on the last stage
        logits = schedule.eval(*([images] if first else []), target=labels if last else None)
        return logits if last else None

    # Loss sum, correct, count on this replica: zeros where no last stage.
    dp_rank, replicas = mesh.get_local_rank("dp"), mesh["dp"].size()
    totals = training.evaluate(pipeline_forward, test_batches, dp_rank, replicas, pipeline=True)
    dist.all_reduce(totals)
    return (totals[:2] / totals[2]).tolist()


def add_arguments(parser):  # the pipeline's flags
    add, positive = parser.add_argument, training.number(int, 1)
    add("--schedule", choices=tuple(SCHEDULES), default="1f1b")
    add("--microbatches", type=positive, default=8, help="microbatches per --batch-size")
    add(
        "--stages-per-rank",
        type=positive,
        default=None,
        help="stages on each rank (default: 1 for gpipe and 1f1b, 2 for the others)",
    )
    add(
        "--data-parallel",
        type=positive,
        default=None,
        help="D pipeline replicas; world size = D x pipeline ranks (default: the fewest whose "
        "pipeline's stages fit model.blocks)",
    )


def make_mesh(args, device, world_size, blocks):
    """world_size / D pipeline ranks (rows) of D replicas (columns), once check_flags has chosen
    D if not given (and said how: returned).

    Pipeline outside, as in torchtitan: a stage's replicas are neighbours, on one node;
    only activations, between neighbouring stages, cross nodes.
    """
    chosen = check_flags(args, world_size, len(blocks))
    shape = (world_size // args.data_parallel, args.data_parallel)
    return init_device_mesh(device.type, shape, mesh_dim_names=("pp", "dp")), chosen


def make_schedule(stages, args, dtype):
    """One schedule for this rank's stages; the last stage computes the loss."""

    def loss_fn(logits, labels):  # on the last stage, per microbatch
        # logits (..., C), targets (...). Divided by the microbatches and micro-steps:
        # the summed gradients are the step's mean, as in DDP.
        loss = F.cross_entropy(logits.to(dtype).flatten(0, -2), labels.flatten())
        return loss / (args.microbatches * args.grad_accum)

    # scale_grads=False: the loss is scaled. The schedule's scaling divides .grad at
    # every step(), which would shrink earlier micro-steps' again.
    schedule_class, stages_kind = SCHEDULES[args.schedule]
    return schedule_class(
        stages[0] if stages_kind == "one" else stages,
        n_microbatches=args.microbatches,
        loss_fn=loss_fn,
        scale_grads=False,
    )


def forward_backward(schedule, stages, images, labels, grad_accum):
    """Collective: a micro-step through the pipeline; its mean loss on the last stage, else 0."""
    # Only the first stage reads inputs; only the last sees targets and losses.
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    losses = [] if last else None
    schedule.step(*([images] if first else []), target=labels if last else None, losses=losses)
    if not last:  # float32 everywhere: an all-reduce takes one dtype
        return torch.zeros((), device=images.device)
    return torch.stack(losses).detach().sum().float() * grad_accum  # loss_fn divided it


def clip_grad_norm(model, tied, max_norm, pp_group, device):
    """Collective: clip to the norm of all stages' gradients (a tied weight's once); returns
    it, before clipping."""
    repeated = {weight.copy for weight in tied if not weight.counted}
    grads = [p.grad for p in model.parameters() if p.grad is not None and p not in repeated]
    squares = torch.nn.utils.get_total_norm(grads).to(device) ** 2  # this rank's (none: a CPU 0)
    dist.all_reduce(squares, group=pp_group)
    norm = squares.sqrt()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    return norm


def average_over_replicas(model, dp_group):
    """Collective: each gradient becomes its mean over the replicas, in one all-reduce."""
    replicas = dist.get_world_size(dp_group)
    if replicas == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]  # its stages'
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=dp_group)
    parts = flat.split([g.numel() for g in grads])
    torch._foreach_copy_(grads, [part.view_as(g) / replicas for g, part in zip(grads, parts)])


def gather_state_dict(model, mesh, tied):
    """Collective: replica 0's stages' weights in one state dict on rank 0 ({} else); a tied
    weight is one tensor under each of its names, as in the whole model's state dict."""
    mine = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine if mesh.get_local_rank("dp") == 0 else {}, gathered, dst=0)
    state = {name: tensor for part in gathered or [] for name, tensor in part.items()}
    for weight in tied if state else ():  # the copies are equal: keep the first stage's
        state |= dict.fromkeys(weight.names, state[weight.names[0]])
    return state


def pipeline_degree(world_size, blocks, per_rank):
    """The most pipeline ranks, a divisor of the world size, whose stages fit the model's blocks
    (None: none do); the other ranks replicate the pipeline."""
    fit = [p for p in range(1, world_size + 1) if world_size % p == 0 and p * per_rank <= blocks]
    return max(fit, default=None)


def check_flags(args, world_size, blocks):
    """Refuse, before any communication, layouts whose schedules fail or hang; choose
    --stages-per-rank and --data-parallel if not given (how, on the start line: returned)."""
    if args.stages_per_rank is None:  # 1 for gpipe and 1f1b, 2 for the others
        args.stages_per_rank = 1 if SCHEDULES[args.schedule][1] == "one" else 2
    per_rank, chosen = args.stages_per_rank, ""
    fits = pipeline_degree(world_size, blocks, per_rank)
    if args.data_parallel is None:  # the fewest replicas whose pipeline fits the blocks
        args.data_parallel = world_size // (fits or 1)
        if fits and args.data_parallel > 1:
            chosen = f" (--data-parallel's default: {blocks} blocks, {fits * per_rank} stages)"
    if world_size % args.data_parallel:
        raise failures.UsageError(
            f"--data-parallel {args.data_parallel} must be a positive divisor of the world size "
            f"{world_size}"
        )
    pipeline_ranks = world_size // args.data_parallel
    num_stages, kind = pipeline_ranks * per_rank, SCHEDULES[args.schedule][1]
    if num_stages > blocks:  # each stage runs at least one block
        remedy = f"--data-parallel {world_size // fits}" if fits else "fewer --stages-per-rank"
        raise failures.UsageError(
            f"{pipeline_ranks} pipeline ranks x {per_rank} stages per rank = {num_stages} stages, "
            f"but model.blocks has only {blocks} blocks: give {remedy}"
        )
    if kind == "one" and per_rank != 1:
        raise failures.UsageError(
            f"--schedule {args.schedule} runs one stage per rank; for --stages-per-rank "
            f"{per_rank} use interleaved-1f1b or looped-bfs"
        )
    if (kind != "one" and per_rank < 2) or (kind == "two, in a V" and per_rank != 2):
        raise failures.UsageError(
            f"--schedule {args.schedule} runs {kind} stages per rank, "
            f"not --stages-per-rank {per_rank}"
        )
    if args.batch_size % args.microbatches:
        raise failures.UsageError(
            f"--batch-size {args.batch_size} does not split into --microbatches "
            f"{args.microbatches} equal microbatches"
        )
    # GPipe too, as torch 2.9 refuses it (2.14 does not: such a step overlaps nothing)
    if args.schedule in ("gpipe", "1f1b", "zbv") and args.microbatches < num_stages:
        raise failures.UsageError(
            f"--schedule {args.schedule} needs at least as many microbatches as stages "
            f"({num_stages}), got --microbatches {args.microbatches}"
        )
    if args.schedule in ("interleaved-1f1b", "interleaved-zb"):
        rounds = max(1, args.microbatches // pipeline_ranks)
        if args.microbatches % rounds:
            raise failures.UsageError(
                f"--schedule {args.schedule} runs microbatches in rounds of {pipeline_ranks} "
                f"(the pipeline ranks): --microbatches {args.microbatches} is not a multiple "
                f"of its {rounds} rounds"
            )
    if args.compile:  # torch 2.14: compiled blocks may return non-contiguous tensors
        raise failures.UsageError(
            "--compile is for train_ddp.py and train_fsdp.py: the pipeline's stages cannot "
            "send the non-contiguous activations compiled blocks may return"
        )
    return chosen


def build_stages(model, args, sample, mesh, fill, autocast):
    """Collective: this rank's PipelineStages, cut from model.blocks, every stage's blocks, and
    the weights tied across stages (tied_weights).

    Stages of about equal FLOPs; this rank allocates and fills only its own blocks (``fill``:
    plumbing/parts.py), the others stay on meta, then become nn.Identity.
    """
    pipeline_ranks, pp_rank = mesh["pp"].size(), mesh.get_local_rank("pp")
    num_stages = pipeline_ranks * args.stages_per_rank
    costs = block_flops(model, parts.on(model, sample))  # of each of model.blocks
    # A rank holds two neighbouring stages in the V (zbv), or in a loop on one rank.
    neighbours = num_stages > 1 and (args.schedule == "zbv" or pipeline_ranks == 1)
    old = torch.__version__ < (2, 14)  # seen on 2.9 and 2.11
    if neighbours and dist.get_backend() == "gloo" and old:
        raise failures.UsageError(
            f"on torch {torch.__version__}, --schedule {args.schedule} with two neighbouring "
            "stages on one rank fails on gloo: its schedules send activations between a rank's "
            'own stages through the process group, and gloo cannot send to its own rank ("Pair '
            'is not connected"); torch 2.14 passes them in memory'
        )
    if neighbours and not args.no_eval:
        raise failures.UsageError(
            f"--schedule {args.schedule} trains, but its forward-only evaluation fails on torch "
            f"{torch.__version__} when a rank holds two neighbouring stages (\"can't "
            "steal_bwd_input if this stage doesn't have backward\"); add --no-eval"
        )
    stage_blocks = balanced_stages(costs, num_stages)  # contiguous blocks per stage
    # A loop puts stage s on rank s % R; the V gives rank r stages r and 2R - 1 - r.
    if args.schedule == "zbv":
        stage_indices = [pp_rank, 2 * pipeline_ranks - 1 - pp_rank]
    else:
        stage_indices = [pp_rank + k * pipeline_ranks for k in range(args.stages_per_rank)]
    local = [block for index in stage_indices for block in stage_blocks[index]]
    holds = [model.blocks[block] for block in local]  # the rest stays on meta
    parts.materialize(model, sample.device, args, fill, log, holds)  # collective
    tied = tied_weights(model, stage_blocks, stage_indices)  # before the cut
    for index in range(len(model.blocks)):
        if index not in local:  # names stay the whole model's, for checkpoints
            model.blocks[index] = nn.Identity()
    group = mesh.get_group("pp")  # this rank's pipeline
    stages = []
    for index in stage_indices:  # model's own blocks: the optimizer's parameters
        stage_model = Stage([model.blocks[block] for block in stage_blocks[index]], autocast)
        stages.append(PipelineStage(stage_model, index, num_stages, sample.device, group=group))
    return stages, stage_blocks, tied


TiedWeight = collections.namedtuple("TiedWeight", "names like copy counted")


def tied_weights(model, stage_blocks, stage_indices):
    """The weights that blocks of different stages share (an LM's embedding and head), as
    TiedWeights, the same list on every rank: its names, an empty tensor like it, this
    rank's copy (None if its stages hold none), whether the norm counts this copy (the
    first stage's). Each stage keeps a copy; sum_tied_grads keeps them equal."""
    stage_of = {block: stage for stage, blocks in enumerate(stage_blocks) for block in blocks}
    mine, found = set(stage_indices), []
    for names in parts.tied_names(model):  # names[0]: this rank's copy, if it holds one
        p, stages = model.get_parameter(names[0]), {stage_of[int(n.split(".")[1])] for n in names}
        if len(stages) > 1 and p.requires_grad:
            copy = p if stages & mine else None
            found.append(TiedWeight(names, p.detach().to("meta"), copy, min(stages) in mine))
    return found


def sum_tied_grads(tied, device, pp_group):
    """Collective: each tied weight's gradient summed over the stages that hold it, an
    all-reduce over the pipeline ranks (zeros from the others): each copy takes the whole
    model's step, as one process would."""
    for weight in tied:  # the same list on every rank: the same all-reduces, in order
        held = weight.copy is not None and weight.copy.grad is not None
        grad = weight.copy.grad if held else torch.zeros_like(weight.like, device=device)
        dist.all_reduce(grad, group=pp_group)
        if weight.copy is not None:
            weight.copy.grad = grad


class Stage(nn.Sequential):
    """Some of the model's blocks as one stage, autocast around forward only (the
    schedule runs backward outside it)."""

    def __init__(self, blocks, autocast):
        super().__init__(*blocks)
        self.autocast = autocast  # reusable: torch.autocast or nullcontext

    def forward(self, x):
        with self.autocast:
            return super().forward(x)


def blocks_of(model):
    """model.blocks, which train_pippy.py cuts into stages; a UsageError if there are none."""
    if not isinstance(getattr(model, "blocks", None), (nn.Sequential, nn.ModuleList)):
        raise failures.UsageError(
            "train_pippy.py cuts model.blocks into stages: give your model a blocks (an "
            "nn.Sequential or nn.ModuleList) that its forward runs in order, and nothing else"
        )
    return model.blocks


def block_flops(model, sample):
    """The FLOPs of each of model.blocks on ``sample``. A UsageError if the model has
    no blocks, or its forward does more than run them in order (the stages would train
    another model), or they fail alone on its input (an embedding outside them)."""
    model.eval()  # grad on: no_grad's fused TransformerEncoderLayer escapes the counter
    blocks = blocks_of(model)
    whole = model(sample)  # a model that fails whole says why, in its own error
    start = "train_pippy.py cuts model.blocks into stages, but your model's forward does more "
    start += "than run its blocks in order"
    flops, x = [], sample
    for index, block in enumerate(blocks):
        try:
            with FlopCounterMode(display=False) as counter:
                x = block(x)
        except Exception as error:  # the blocks' own failure (an embedding outside them)
            before = f"model.blocks[{index - 1}]'s output" if index else "the model's input"
            raise failures.UsageError(
                f"{start}: model.blocks[{index}] ({type(block).__name__}) fails on {before} "
                f"({type(error).__name__}): move the work your forward does outside blocks into "
                "them, in order (an embedding first, a head last)"
            ) from None
        flops.append(counter.get_total_flops())
    model.train()
    same = x.is_meta or torch.allclose(x, whole, rtol=1e-3, atol=1e-6)  # meta: the shapes
    if x.shape != whole.shape or not same:
        raise failures.UsageError(f"{start}: move that work into blocks (nn.Flatten(), ...)")
    return flops


def balanced_stages(costs, num_stages):
    """Contiguous groups of block indices, one per stage, whose costliest costs the least.

    A pipeline runs at its slowest stage's pace; the blocks after the first group are
    split by the same rule.
    """

    @functools.cache
    def best(start, stages):  # (the costliest group's cost, groups) from block start
        if stages == 1:
            return sum(costs[start:]), (tuple(range(start, len(costs))),)
        return min(
            (
                max(sum(costs[start:end]), best(end, stages - 1)[0]),
                (tuple(range(start, end)),) + best(end, stages - 1)[1],
            )
            for end in range(start + 1, len(costs) - stages + 2)
        )

    return [list(group) for group in best(0, num_stages)[1]]


if __name__ == "__main__":
    failures.run(main, data.DataError)  # one-line errors, exit codes
