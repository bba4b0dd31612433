"""Train BabyCNN with pipeline parallelism (torch.distributed.pipelining): each rank runs some blocks.

Launch (the README and run_pippy.sh use the same commands):
    python train_pippy.py                                     # one process: one stage, no pipeline
    torchrun --standalone --nproc-per-node=2 train_pippy.py   # one node, 2 stages
    torchrun --nnodes=2 --node-rank=$NODE_RANK --nproc-per-node=2 --rdzv-backend=c10d \
        --rdzv-endpoint=$MASTER_ADDR:29500 --rdzv-id=babycnn train_pippy.py # two nodes: on each node
Through the wrapper: `bash run_pippy.sh [flags]`; for two nodes, on each node,
`NNODES=2 NODE_RANK=0|1 MASTER_ADDR=node0 MASTER_PORT=29500 bash run_pippy.sh [flags]`.

What pipeline parallelism changes compared with train_ddp.py:
  setup  a device mesh: pipeline ranks x data-parallel replicas (--data-parallel D)
  model  built whole from the seed, as in train_ddp.py; model.blocks is cut into stages of about equal FLOPs,
         and each rank keeps only its stages' blocks (the others become nn.Identity)
  wrap   each local stage becomes a PipelineStage; a schedule (GPipe, 1F1B, interleaved, ...) runs
         the microbatches through all of them
  loop   schedule.step(): the first stage feeds inputs, the last stage computes the loss; the
         logged loss comes from the last stage; with D > 1, after the last micro-step, one all-reduce
         averages each stage's gradients across its replicas (as DDP would, once per optimizer step)
  save   every stage's weights are gathered on rank 0, which writes one plain state dict
Every collective is called here, or in a call marked "collective" (every rank must make it).
"""

import functools
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS, ScheduleZBVZeroBubble,
)
from torch.utils.data.distributed import DistributedSampler
from torch.utils.flop_counter import FlopCounterMode

from models import BabyCNN, data
from plumbing import core, hardening

# name: (schedule class, stages per rank it runs)
SCHEDULES = {
    "gpipe": (ScheduleGPipe, "one"),
    "1f1b": (Schedule1F1B, "one"),
    "interleaved-1f1b": (ScheduleInterleaved1F1B, "several"),
    "looped-bfs": (ScheduleLoopedBFS, "several"),
    "interleaved-zb": (ScheduleInterleavedZeroBubble, "several"),
    "zbv": (ScheduleZBVZeroBubble, "two, in a V"),
}


def main():
    parser = core.parser(__doc__.splitlines()[0], data.add_arguments)
    parser.add_argument("--schedule", choices=tuple(SCHEDULES), default="1f1b")
    parser.add_argument("--microbatches", type=core.number(int, 1), default=8,
                        help="microbatches each --batch-size is split into")
    parser.add_argument("--stages-per-rank", type=core.number(int, 1), default=None,
                        help="stages on each rank (default: 1 for gpipe and 1f1b, 2 for the others)")
    parser.add_argument("--data-parallel", type=core.number(int, 1), default=1,
                        help="D pipeline replicas; world size = D x pipeline ranks")
    args = parser.parse_args()

    # ---- setup: one process per device, all of them in one process group ----
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # rank on this node: picks the GPU
    if core.use_cuda(args.device, local_rank):  # --device; one line if this node has too few GPUs
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    dtype, autocast = core.precision(args, device)  # the weights' dtype; bf16 autocast for the forward, or nothing
    # Find (or download) the data before the process group: no collective's timeout runs during a download.
    found = data.find(args.dataset, args.data_dir, download=not args.no_download)
    timeout = timedelta(minutes=10)  # a collective that waits longer than this fails instead of hanging
    if "RANK" in os.environ:  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        store = hardening.store_for_this_attempt(timeout)  # torchrun's, this restart's own part (None: env://)
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), timeout=timeout,
                                world_size=int(os.environ["WORLD_SIZE"]),
                                device_id=device if device.type == "cuda" else None)
    else:  # plain `python train_pippy.py`: a group of one, so every collective below runs unchanged
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # rank decides who logs and writes files
    progress = None
    try:
        log = core.log if rank == 0 else (lambda line: None)  # above rank 0's progress bar

        # The device mesh: world_size / D pipeline ranks (rows), each with D replicas (columns). Pipeline
        # outermost, as in torchtitan: a stage's D replicas are neighbouring ranks, so on one node where
        # they fit, and the data-parallel all-reduce (every gradient, every step) stays on the fast links;
        # only activations, between neighbouring stages, cross nodes.
        if world_size % args.data_parallel:
            raise core.UsageError(
                f"--data-parallel {args.data_parallel} must be a positive divisor of the world size {world_size}")
        pipeline_ranks = world_size // args.data_parallel
        mesh = init_device_mesh(device.type, (pipeline_ranks, args.data_parallel), mesh_dim_names=("pp", "dp"))
        dp_rank, pp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
        schedule_class, stages_kind = SCHEDULES[args.schedule]
        stages_per_rank = args.stages_per_rank or (1 if stages_kind == "one" else 2)
        num_stages = pipeline_ranks * stages_per_rank
        if stages_kind == "one" and stages_per_rank != 1:
            raise core.UsageError(f"--schedule {args.schedule} runs one stage per rank; for --stages-per-rank "
                                  f"{stages_per_rank} use interleaved-1f1b or looped-bfs")
        if (stages_kind != "one" and stages_per_rank < 2) or (stages_kind == "two, in a V" and stages_per_rank != 2):
            raise core.UsageError(f"--schedule {args.schedule} runs {stages_kind} stages per rank, "
                                  f"not --stages-per-rank {stages_per_rank}")
        check_microbatches(args, num_stages, pipeline_ranks)
        if args.compile:
            # Seen on torch 2.14: compiled blocks may return non-contiguous activations, which the stages'
            # send refuses ("input tensor has to be contiguous").
            raise core.UsageError("--compile is for train_ddp.py and train_fsdp.py: the pipeline's stages cannot "
                                  "send the non-contiguous activations compiled blocks may return")

        # ---- data: map-style Datasets (bundled: on the device); DistributedSampler deals this replica's share ----
        dataset_name, train_set, test_set = data.load(found, device, dtype, args.workers, log)  # collective
        # Data parallelism is across replicas: every stage of replica d walks the same shard d. drop_last: without
        # it, the sampler pads the shards to equal length by repeating samples, so some would count twice in an
        # epoch and no longer match one process on the whole set
        sampler = DistributedSampler(
            train_set, num_replicas=args.data_parallel, rank=dp_rank, shuffle=True, seed=args.seed,
            drop_last=True
        )
        samples_per_step = args.batch_size * args.grad_accum  # per replica, per optimizer step
        steps_per_epoch = len(sampler) // samples_per_step
        if steps_per_epoch == 0:
            raise core.UsageError(
                f"--batch-size {args.batch_size} x --grad-accum {args.grad_accum} is more than the "
                f"{len(sampler)} samples each of the {args.data_parallel} replicas gets from {dataset_name}; "
                "make it smaller"
            )
        global_batch_size = samples_per_step * args.data_parallel
        total_steps = min(args.max_steps or steps_per_epoch * args.epochs, steps_per_epoch * args.epochs)
        # Batches on the device: the bundled data gathered there, a Dataset of yours through a DataLoader (--workers)
        seed = hash((args.seed, dp_rank))  # this replica's workers' random streams
        train_batches = core.Batches(train_set, args.batch_size, device, dtype, args.workers, seed)
        test_batches = core.Batches(test_set, args.batch_size, device, dtype, args.workers)

        # ---- model: whole on every rank, from the seed (the initial weights of train_ddp.py, for any model) ----
        # Then each rank keeps only its stages' blocks. (A model too big for one device is built on the meta device
        # instead, and each rank initialises its blocks: docs/pipeline.md says how.)
        torch.manual_seed(args.seed)
        channels, size = train_set[0][0].shape[:2]  # of one sample (C, H, W): BabyCNN's input
        model = BabyCNN(channels, data.NUM_CLASSES, size, args.width, device=device, dtype=dtype)
        if args.init_from:  # rank 0 reads the file, and broadcasts each weight to the others
            hardening.init_from(model, args.init_from)  # collective
        param_count = sum(p.numel() for p in model.parameters())
        flops = core.flops_per_sample(model, train_set, device, dtype)  # one sample's forward and backward
        sample = next(core.Batches(train_set, 1, device, dtype)([0]))[0]  # one input, as the first stage gets it
        costs = block_flops(model, sample)  # of each of model.blocks, which the stages are cut from
        if num_stages > len(costs):
            raise core.UsageError(f"{pipeline_ranks} pipeline ranks x {stages_per_rank} stages per rank = "
                                  f"{num_stages} stages, but model.blocks has only {len(costs)} blocks")
        # A rank holds two neighbouring stages in the V (zbv), and in the loop placement with one pipeline rank.
        neighbours_on_one_rank = num_stages > 1 and (args.schedule == "zbv" or pipeline_ranks == 1)
        if neighbours_on_one_rank and backend == "gloo" and torch.__version__ < (2, 14):  # seen on 2.9 and 2.11
            raise core.UsageError(
                f"on torch {torch.__version__}, --schedule {args.schedule} with two neighbouring stages on one rank "
                "fails on gloo: its schedules send activations between a rank's own stages through the process group, "
                "and gloo cannot send to its own rank (\"Pair is not connected\"); torch 2.14 passes them in memory"
            )
        if neighbours_on_one_rank and not args.no_eval:
            raise core.UsageError(
                f"--schedule {args.schedule} trains, but its forward-only evaluation fails on torch "
                f"{torch.__version__} when a rank holds two neighbouring stages (\"can't steal_bwd_input if this "
                "stage doesn't have backward\"); add --no-eval"
            )
        stage_blocks = balanced_stages(costs, num_stages)  # contiguous blocks per stage
        blocks = model.blocks
        # Loop placement puts stage s on rank s % ranks; the V (zbv) gives rank r stages r and 2 x ranks - 1 - r.
        if args.schedule == "zbv":
            stage_indices = [pp_rank, 2 * pipeline_ranks - 1 - pp_rank]
        else:
            stage_indices = [pp_rank + k * pipeline_ranks for k in range(stages_per_rank)]
        local_blocks = [block for stage_index in stage_indices for block in stage_blocks[stage_index]]
        for block_index in range(len(blocks)):
            if block_index not in local_blocks:
                # Parameter names stay the whole model's (blocks.2.conv1.weight): checkpoints and saves line up.
                blocks[block_index] = nn.Identity()

        # ---- wrap: a PipelineStage per local stage, one schedule for all ----
        pp_group = mesh.get_group("pp")
        stages = []
        for stage_index in stage_indices:
            # Shares model's blocks: the optimizer and the checkpoints see the same parameters.
            stage_model = Stage([blocks[block] for block in stage_blocks[stage_index]], autocast)
            stages.append(PIPELINE_STAGE(stage_model, stage_index, num_stages, device, group=pp_group))
        has_first_stage, has_last_stage = 0 in stage_indices, num_stages - 1 in stage_indices

        def loss_fn(logits, labels):  # runs on the last stage, once per microbatch, in the weights' dtype (not bf16)
            # Each microbatch's mean loss, divided by the microbatches and the micro-steps: the summed
            # gradients are then the mean over the whole step, as in train_ddp.py.
            return F.cross_entropy(logits.to(dtype), labels) / (args.microbatches * args.grad_accum)

        # scale_grads=False: we scale the loss instead. The schedule's own scaling (its default) divides
        # the whole .grad by the microbatch count at the end of every step(), so with --grad-accum it
        # would shrink the earlier micro-steps' gradients again at each later one.
        schedule = schedule_class(stages[0] if stages_kind == "one" else stages, n_microbatches=args.microbatches,
                                  loss_fn=loss_fn, scale_grads=False)
        peak_lr, warmup_steps, lr_at = core.lr_schedule(args, global_batch_size, total_steps)
        optimizer = core.make_optimizer(args, model.parameters())

        # ---- resume: every rank loads its part of the newest checkpoint in --checkpoint-dir, if any ----
        checkpointer = hardening.Checkpointer(args, dataset_name, global_batch_size, device)
        resumed = checkpointer.check_outputs_and_resume(model, optimizer, peak_lr, log)  # collective
        log(
            f"pipeline ({args.schedule}, {num_stages} stages: blocks {stage_blocks}) x {args.data_parallel} replica(s) "
            f"on {world_size} rank(s) ({backend}, {device.type}): batch {args.batch_size} per replica in "
            f"{args.microbatches} microbatches x grad-accum {args.grad_accum} x {args.data_parallel} replicas = global "
            f"batch {global_batch_size}; peak lr {peak_lr:g} after {warmup_steps} warmup steps; "
            f"{param_count:,} parameters; {flops / 1e6:,.1f} MFLOPs a sample; {args.precision}; {dataset_name}; "
            f"{total_steps} steps"
        )

        # ---- train loop ----
        progress = core.Progress(total_steps, global_batch_size, args.log_every, device, log, resumed["step"],
                                 args.log_dir)
        profiler = core.Profiler(args, rank, device, resumed["step"], total_steps)  # one line if it cannot
        window_loss, window_count = torch.zeros((), device=device), 0  # summed on the device: no per-step sync
        stop, stop_signal = hardening.StopSignals(rank, resumed["step"]), 0  # stop_signal: the one ranks agreed on
        test_loss = test_accuracy = None  # stay None with --no-eval
        first_epoch, first_step_in_epoch = resumed["epoch"], resumed["samples_into_epoch"] // global_batch_size
        for epoch in range(first_epoch, -(-total_steps // steps_per_epoch)):
            sampler.set_epoch(epoch)  # a new shuffle each epoch, the same permutation on every rank
            model.train()
            progress.start_epoch(epoch)
            first = first_step_in_epoch if epoch == first_epoch else 0
            last = min(steps_per_epoch, first + total_steps - progress.step)
            batches = train_batches(list(sampler)[first * samples_per_step :])  # from where a resumed run stopped
            for step_in_epoch in range(first, last):
                optimizer.zero_grad(set_to_none=True)
                for micro_step in range(args.grad_accum):
                    images, labels = next(batches)
                    # Only the first stage reads inputs, only the last one sees targets and losses.
                    losses = []
                    # Sends and receives activations and gradients between neighbouring stages: every pipeline rank
                    schedule.step(*([images] if has_first_stage else []), target=labels if has_last_stage else None,
                                  losses=losses if has_last_stage else None)
                    if has_last_stage:  # the micro-step's mean loss (loss_fn divided it by microbatches x grad_accum)
                        window_loss += torch.stack(losses).detach().sum() * args.grad_accum
                    window_count += 1
                grads = [p.grad for p in model.parameters() if p.grad is not None]  # this rank's stages'
                if args.data_parallel > 1:  # average each gradient with the same stage's other replicas: one all-reduce
                    flat = torch.cat([g.flatten() for g in grads])
                    dist.all_reduce(flat, group=mesh.get_group("dp"))
                    torch._foreach_copy_(grads, [part.view_as(g) / args.data_parallel
                                                 for g, part in zip(grads, flat.split([g.numel() for g in grads]))])
                if args.max_grad_norm:  # the norm of the whole model: every stage's gradients, on every pipeline rank
                    squares = torch.nn.utils.get_total_norm(grads) ** 2  # this rank's stages only
                    dist.all_reduce(squares, group=pp_group)  # their sum over the pipeline ranks (replicas agree)
                    grad_norm = squares.sqrt()
                    torch.nn.utils.clip_grads_with_norm_(model.parameters(), args.max_grad_norm, grad_norm)
                lr = lr_at(progress.step)  # a function of the step: resumes exactly
                for group in optimizer.param_groups:
                    group["lr"] = lr
                optimizer.step()
                log_now = progress.update(end_of_epoch=step_in_epoch == last - 1)
                if log_now or stop.due(progress.step):  # and about once a second: the same steps on every rank
                    # A signal reaches the ranks at different steps: they compare here, and all stop at this one.
                    agreed = stop.proposal(device)  # [the signal received here or 0, -(steps to the next check)]
                    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
                    stop_signal = stop.agree(agreed, progress.step)
                if log_now or stop_signal:
                    # Only last stages hold a loss (others add 0): the all-reduce brings it to rank 0.
                    dist.all_reduce(window_loss)
                    mean_loss = window_loss.item() / (window_count * args.data_parallel)
                    if not math.isfinite(mean_loss):  # the same all-reduced value on every rank: all stop here
                        raise checkpointer.diverged(progress.step, f"the training loss is {mean_loss}")
                    norm = grad_norm.item() if args.max_grad_norm else None  # the last step's, before clipping
                    progress.record_loss(mean_loss, "loss (last stage)", lr, norm)
                    window_loss.zero_()
                    window_count = 0
                profiler.after_step(progress.step)  # --profile-steps: starts or stops here
                # Also at the last step: a job requeued after it finished finds nothing left to train.
                last_step = progress.step == total_steps
                if args.checkpoint_dir and (stop_signal or last_step or progress.step % args.checkpoint_every == 0):
                    for buffer in model.buffers():  # each replica's own running statistics: replica 0's are saved
                        dist.broadcast(buffer, group=mesh.get_group("dp"), group_src=0)
                    position = {"epoch": epoch, "samples_into_epoch": (step_in_epoch + 1) * global_batch_size}
                    checkpointer.save(  # collective: all ranks; it refuses weights or a loss that are not finite
                        progress.step, position, model, optimizer, peak_lr, window_loss)
                if stop_signal and not last_step:  # at the last step it just finishes
                    stop.say_and_exit(stop_signal, progress.step, total_steps, args.checkpoint_dir)

            # ---- evaluate: each replica scores a slice of the test set; the sums are all-reduced ----
            if args.no_eval:
                continue
            for buffer in model.buffers():  # BatchNorm's statistics, each replica's own: replica 0's, which it saves
                dist.broadcast(buffer, group=mesh.get_group("dp"), group_src=0)
            model.eval()

            def pipeline_forward(images, labels):  # forward only, through every stage: logits on the last one
                logits = schedule.eval(*([images] if has_first_stage else []),
                                       target=labels if has_last_stage else None)
                return logits if has_last_stage else None

            totals = core.evaluate(pipeline_forward, test_batches, dp_rank, args.data_parallel,
                                   pipeline=True)  # zeros where no last stage
            dist.all_reduce(totals)
            test_loss, test_accuracy = (totals[:2] / totals[2]).tolist()
            progress.record_test(test_loss, test_accuracy)  # --log-dir's row
            log(
                f"epoch {epoch + 1}: step {progress.step}, train loss {progress.final_train_loss:.4f} (last stage), "
                f"test loss {test_loss:.4f}, test accuracy {test_accuracy:.2%}"
            )

        progress.close()  # the bar's last state stays on the screen

        # ---- save: replica 0's stages send their weights to rank 0, which writes one state dict ----
        if args.save:
            mine = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
            gathered = [None] * world_size if rank == 0 else None
            dist.gather_object(mine if dp_rank == 0 else {}, gathered, dst=0)
            hardening.on_rank_0(lambda: core.save_state_dict(  # collective: rank 0's failure is every rank's
                {name: t for part in gathered for name, t in part.items()}, args.save), "writing --save")
            log(f"saved the weights to {args.save}")
        if args.metrics:  # every rank sends what it holds to rank 0, which writes the summary
            ranks = [None] * world_size
            dist.all_gather_object(ranks, {"rank": rank, "stages": stage_indices,
                                           "blocks": [stage_blocks[i] for i in stage_indices],
                                           **core.memory(model, optimizer, device)})
            if rank == 0:
                core.save_json({
                    "strategy": "pipeline", "schedule": args.schedule, "microbatches": args.microbatches,
                    "stages": num_stages, "data_parallel": args.data_parallel, "world_size": world_size,
                    "global_batch_size": global_batch_size, **progress.summary(), "test_loss": test_loss,
                    "test_accuracy": test_accuracy, "param_count": param_count, "precision": args.precision,
                    "dataset": dataset_name, "peak_lr": peak_lr, "ranks": ranks,
                    **core.throughput(flops, progress.rate(), world_size, device, args.precision),
                }, args.metrics)
    finally:
        if progress:  # the CSV and TensorBoard's events are closed however the run ends
            progress.close()
        schedule = stages = pp_group = mesh = None  # they hold the groups: let go, and destroy ends gloo's threads
        dist.destroy_process_group()


class Stage(nn.Sequential):
    """Some of BabyCNN's blocks, run as one pipeline stage, with autocast around their forward only: the
    schedule runs backward outside it (autocast belongs to the forward; backward ops follow its dtypes)."""

    def __init__(self, blocks, autocast):
        super().__init__(*blocks)
        self.autocast = autocast  # a reusable context: torch.autocast or nullcontext

    def forward(self, x):
        with self.autocast:
            return super().forward(x)


class OlderPipelineStage(PipelineStage):
    """A PipelineStage without three bugs of torch before 2.14 (seen on 2.9 and 2.11). On 2.9, at the first step() or
    eval(), its schedules open the links between stages by sending an int64 scalar into a float32 buffer: gloo aborts
    ("8 vs 4. Received data size doesn't match expected size"; fixed in 2.10, pytorch PR 165539). An eval() before
    the first step() (a run resumed at an epoch's end) sets the stage up without its backward, for good: that step()
    fails (pytorch issue 162822). And on 2.9, to learn the shape of its output, a stage runs its blocks once on
    zeros in training mode: BatchNorm counts that batch in its running statistics (2.14 runs them on meta)."""

    # All override private methods of those releases' stage.
    def _get_init_p2p_neighbors_ops(self):
        ops = super()._get_init_p2p_neighbors_ops()
        for op in ops:
            op.tensor = op.tensor.float()  # a send's int64 stage index; a receive's buffer is float32 already
        return ops

    def _prepare_forward_infra(self, num_microbatches, *args, **kwargs):
        # Set up as a first step() does, even in an eval() (has_backward False): these stages train.
        training, self.has_backward = self.has_backward, True
        outputs = super()._prepare_forward_infra(num_microbatches, *args, **kwargs)
        self._prepare_backward_infra(num_microbatches)
        self.has_backward = training
        return outputs

    def _shape_inference(self, *args, **kwargs):
        training = self.submod.training
        self.submod.eval()  # the same shapes, and no running statistics updated
        try:
            return super()._shape_inference(*args, **kwargs)
        finally:
            self.submod.train(training)


# Before 2.14 only: 2.14 needs none of these workarounds, and later releases may change the private methods they override.
PIPELINE_STAGE = PipelineStage if torch.__version__ >= (2, 14) else OlderPipelineStage


@torch.no_grad()
def block_flops(model, sample):
    """The FLOPs of each of model.blocks on ``sample``, in eval mode (no running statistics change). Raises a
    UsageError (one line, exit 2) if the model has no blocks, or if its forward does more than run them in order:
    the stages would train another model."""
    if not isinstance(getattr(model, "blocks", None), (nn.Sequential, nn.ModuleList)):
        raise core.UsageError("train_pippy.py cuts model.blocks into stages: give your model a blocks "
                              "(an nn.Sequential) that its forward runs in order, and nothing else")
    model.eval()
    flops, x = [], sample
    for block in model.blocks:
        with FlopCounterMode(display=False) as counter:
            x = block(x)
        flops.append(counter.get_total_flops())
    whole = model(sample)
    model.train()
    if x.shape != whole.shape or not torch.allclose(x, whole, rtol=1e-3, atol=1e-6):
        raise core.UsageError("train_pippy.py cuts model.blocks into stages, but your model's forward does more than "
                              "run its blocks in order: move that work into blocks (nn.Flatten(), ...)")
    return flops


def balanced_stages(costs, num_stages):
    """Contiguous groups of block indices, one per stage, whose costliest group costs the least (a pipeline runs at
    the pace of its slowest stage); the blocks after the first group are split by the same rule."""
    @functools.cache
    def best(start, stages):  # (cost of the costliest group, the groups) of blocks start, start + 1, ...
        if stages == 1:
            return sum(costs[start:]), (tuple(range(start, len(costs))),)
        return min((max(sum(costs[start:end]), best(end, stages - 1)[0]), (tuple(range(start, end)),)
                    + best(end, stages - 1)[1]) for end in range(start + 1, len(costs) - stages + 2))

    return [list(group) for group in best(0, num_stages)[1]]


def check_microbatches(args, num_stages, pipeline_ranks):
    """Refuse, before any communication, the layouts whose schedules would fail or hang."""
    if args.batch_size % args.microbatches:
        raise core.UsageError(
            f"--batch-size {args.batch_size} does not split into --microbatches {args.microbatches} equal microbatches")
    # GPipe too, as torch 2.9 refuses it (2.14 does not: a step with fewer microbatches than stages overlaps nothing)
    if args.schedule in ("gpipe", "1f1b", "zbv") and args.microbatches < num_stages:
        raise core.UsageError(f"--schedule {args.schedule} needs at least as many microbatches as stages "
                              f"({num_stages}), got --microbatches {args.microbatches}")
    if args.schedule in ("interleaved-1f1b", "interleaved-zb"):
        rounds = max(1, args.microbatches // pipeline_ranks)
        if args.microbatches % rounds:
            raise core.UsageError(
                f"--schedule {args.schedule} runs microbatches in rounds of {pipeline_ranks} (the pipeline ranks): "
                f"--microbatches {args.microbatches} is not a multiple of its {rounds} rounds"
            )


if __name__ == "__main__":
    hardening.run(main, data.DataError)  # one-line errors; under torchrun, die with it
