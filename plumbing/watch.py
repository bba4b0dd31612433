"""Watching a run: rank 0's lines and bar, the loss curve, FLOPs, the start line."""

import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from tqdm import tqdm

from plumbing.failures import is_rank_0


def log(line):
    """Rank 0's lines, on stdout, above its progress bar."""
    if is_rank_0():
        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()


class Progress:
    """Rank 0's bar (in a terminal) or lines; the loss curve and the training clock, read only at
    logging steps (a GPU syncs); --log-dir's rows and --profile-steps' traces, if given."""

    def __init__(self, plan, args, device, start_step=0):
        self.total_steps, self.log_every = plan.total_steps, args.log_every
        self.global_batch_size = plan.global_batch_size
        self.start_step = self.step = start_step  # a resumed run counts on
        self.train_seconds, self.loss_curve, self.final_train_loss = 0.0, [], float("nan")
        self.whose = ""  # whose loss it is, from record_loss's label
        self.grad_norms = []  # [step, norm before clipping], if clipped
        self.test_loss = self.test_accuracy = None  # the last evaluation's
        self.device = device
        self.synchronize = torch.accelerator.synchronize if device.type != "cpu" else lambda: None
        shown = is_rank_0() and sys.stdout.isatty()
        options = dict(unit="step", file=sys.stdout, dynamic_ncols=True, disable=not shown)
        self.bar = tqdm(total=self.total_steps, initial=start_step, **options)
        self.rows = self.profiler = None  # opt-in: --log-dir's, --profile-steps'
        if args.log_dir and is_rank_0():
            from plumbing import log_dir

            self.rows = log_dir.MetricsLog(args.log_dir, start_step, log)
        if args.profile_steps:
            from plumbing import profile_steps

            self.profiler = profile_steps.Profiler(args, device, start_step, self.total_steps, log)

    def start_epoch(self, epoch):  # the clock restarts: epochs end at logging steps
        self.epoch = epoch
        self.bar.set_description(f"epoch {epoch + 1}", refresh=False)
        self.synchronize()
        self.started = time.perf_counter()

    def count_step(self):
        self.step += 1
        self.bar.update()  # no device wait: the bar reads the host's clock

    def after_step(self):  # the step's collectives done: --profile-steps' traces hold whole steps
        if self.profiler:
            self.profiler.after_step(self.step)

    def is_logging_step(self, end_of_epoch):  # the loss is reduced and logged
        return self.step % self.log_every == 0 or self.step == self.total_steps or end_of_epoch

    def record_loss(self, loss, label, lr, norm=None):
        """A logging step's loss: bar, line, row; ``norm``: a tensor, before clipping."""
        grad_norm = None if norm is None else norm.item()
        self.synchronize()
        now = time.perf_counter()
        self.train_seconds, self.started = self.train_seconds + now - self.started, now
        self.final_train_loss, self.whose = loss, label.removeprefix("loss ")  # "(all ranks)"
        self.loss_curve.append([self.step, loss, self.train_seconds])
        norm = ""
        if grad_norm is not None:
            self.grad_norms.append([self.step, grad_norm])
            norm = f", grad norm {grad_norm:.4g}"
        rate = f"{self.rate():,.0f} samples/s"
        if self.bar.disable:
            step = f"step {self.step}/{self.total_steps}"
            log(f"{step}: {label} {loss:.4f}, lr {lr:.3g}{norm}, {rate}")
        self.bar.set_postfix_str(f"{label} {loss:.4f}, {rate}")
        if self.rows:
            row = {"step": self.step, "epoch": self.epoch + 1, "train_loss": loss, "lr": lr}
            self.rows.write(**row, grad_norm=grad_norm, samples_per_second=self.rate())

    def record_test(self, test_loss, test_accuracy):  # the epoch's line and row
        self.test_loss, self.test_accuracy = test_loss, test_accuracy
        train = f"train loss {self.final_train_loss:.4f} {self.whose}"
        test = f"test loss {test_loss:.4f}, test accuracy {test_accuracy:.2%}"
        log(f"epoch {self.epoch + 1}: step {self.step}, {train}, {test}")
        if self.rows:
            row = {"step": self.step, "epoch": self.epoch + 1, "test_loss": test_loss}
            self.rows.write(**row, test_accuracy=test_accuracy)

    def close(self):  # the bar stays on the screen
        self.bar.close()
        if self.rows:
            self.rows.close()
            self.rows = None

    def rate(self):  # samples per second of training
        samples = (self.step - self.start_step) * self.global_batch_size
        return samples / max(self.train_seconds, 1e-9)


def flops_per_sample(model, inputs):
    """FLOPs of a forward and a backward on one sample (``training.check_data_fits`` ran it)."""
    model.eval()  # BatchNorm takes one sample; no running statistic moves
    # Attention as matmuls, which the counter counts: it sees no FLOPs in the CPU's fused kernel.
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(inputs).sum().backward()
    model.train()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def describe(args, plan, param_count, flops, unit="rank"):
    """The start line's figures; ``unit``: a data-parallel replica."""
    replicas = plan.global_batch_size // plan.samples_per_step
    top = ""
    if plan.top_lr < plan.peak_lr:  # a cosine, from step 0
        top = f"the cosine, from step 0, makes it {plan.top_lr:.3g} there; "
    return (
        f"batch {args.batch_size} per {unit} x grad-accum {args.grad_accum} x {replicas} "
        f"{unit}s = global batch {plan.global_batch_size}; peak lr {plan.peak_lr:g} after "
        f"{plan.warmup_steps} warmup steps; {top}{param_count:,} parameters; "
        f"{flops / 1e6:,.1f} MFLOPs a sample; {args.precision}"
        f"{', deterministic' if args.deterministic else ''}; {plan.dataset_name}; "
        f"{plan.total_steps} steps"
    )
