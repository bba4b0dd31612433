"""Count the host's work in a GPT training step: its aten:: events and its casts, by torch.profiler.

    OMP_NUM_THREADS=1 python docs/host_work.py        # about a minute on a 2-core CPU machine

On a GPU whose kernels finish fast, a step takes as long as the host takes to issue it: Python and
the dispatcher run every aten:: op (each cast, view and sum too) before its kernel can start. So the
count of a step's aten:: events is its host work, and it does not depend on the device's speed.
Counted here on the CPU (torch.profiler, every aten:: event of the step, nested ones included; the
casts are aten::to and aten::_to_copy), at the gpt-gpu sizes (6 layers, 6 heads, 384 wide), batch 2
of 256 positions:

  the model's step   nanoGPT's: zero_grad, the forward under bf16 autocast, the cross-entropy,
                     backward, clip_grad_norm_ and fused AdamW, on the GPT alone, at dropout 0
                     and 0.2 (gpt-gpu's);
  train_ddp.py's     one step of the real script (--model gpt-gpu --precision bf16 --batch-size 2
                     --max-grad-norm 1, one process), read from its --profile-steps trace: the
                     loop's iteration from one optimizer step's end to the next (the lr, the
                     logging, the stop agreement, the loss kept for the log), over the model's step.

The budgets: nanoGPT's own model at these sizes counted 2,698 events and 328 casts at dropout 0,
3,626 and 528 at dropout 0.2 (torch 2.14.1, issue 62); the GPT at most 2,750 and 340, and as much
more at 0.2 as nanoGPT's; the script's step at most 5 % over the model's. Prints a table; writes
docs/results/host_work.json.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from models import GPT  # noqa: E402
from models.gpt import SIZES  # noqa: E402

CASTS = ("aten::to", "aten::_to_copy")
NANOGPT = {0.0: (2698, 328), 0.2: (3626, 528)}  # (events, casts) of nanoGPT's model, issue 62
BUDGET = {p: (round(2750 * e / 2698), round(340 * c / 328)) for p, (e, c) in NANOGPT.items()}
SCRIPT_OVER_MODEL = 0.05  # the most the script's loop may add to the model's step
BATCH, CONTEXT = 2, 256


def count(events):
    """(aten:: events, casts) of a list of chrome-trace events (dicts with a "name")."""
    names = Counter(e["name"] for e in events if e["name"].startswith("aten::"))
    return sum(names.values()), sum(names[c] for c in CASTS)


def read(trace):
    """The trace's complete events ("X": ops, annotations such as Optimizer.step), by start."""
    events = json.loads(Path(trace).read_text())["traceEvents"]
    return sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])


def steps(ops):
    """The ops of each optimizer step's loop iteration: from one step's end to the next's."""
    ends = [e["ts"] + e["dur"] for e in ops if e["name"].startswith("Optimizer.step#")]
    return [[e for e in ops if start <= e["ts"] < end] for start, end in zip(ends, ends[1:])]


def model_step(dropout, sizes="gpt-gpu"):
    """(events, casts) of one step of nanoGPT's loop on the GPT alone, after one untraced step."""
    torch.manual_seed(0)
    model = GPT(65, CONTEXT, **{**SIZES[sizes], "dropout": dropout})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    ids = torch.randint(0, 65, (2, BATCH, CONTEXT), generator=torch.Generator().manual_seed(0))
    inputs, targets = ids.unbind()

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    step()  # the optimizer's state made, out of the trace
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        profile.export_chrome_trace(str(path))
        return count(read(path))


def script_step(max_steps=2):
    """(events, casts) of train_ddp.py's last traced step at gpt-gpu, bf16, batch 2, one process."""
    with tempfile.TemporaryDirectory() as folder:
        flags = ["--model", "gpt-gpu", "--precision", "bf16", "--batch-size", str(BATCH)]
        flags += ["--max-steps", str(max_steps), "--no-eval", "--log-dir", folder]
        flags += ["--profile-steps", f"{max_steps - 1}:{max_steps}", "--device", "cpu"]
        argv = [sys.executable, "train_ddp.py", *flags]
        run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
        if run.returncode:
            sys.exit(f"train_ddp.py exited {run.returncode}:\n{run.stdout}{run.stderr}")
        return count(steps(read(Path(folder) / "trace-rank0.json"))[-1])


def measure():
    results = {f"model_dropout_{p}": model_step(p) for p in NANOGPT}
    results["train_ddp"] = script_step()
    return results


def table(results):
    rows = ["| step | aten events | casts | budget |", "| --- | --- | --- | --- |"]
    for p in NANOGPT:
        (events, casts), (most, most_casts) = results[f"model_dropout_{p}"], BUDGET[p]
        rows.append(
            f"| the GPT's, dropout {p} | {events:,} | {casts:,} | {most:,} and {most_casts:,} "
            f"(nanoGPT's model: {NANOGPT[p][0]:,} and {NANOGPT[p][1]:,}) |"
        )
    (events, casts), (model, model_casts) = results["train_ddp"], results["model_dropout_0.2"]
    rows.append(
        f"| train_ddp.py's, gpt-gpu (dropout 0.2) | {events:,} ({events / model - 1:+.1%}) | "
        f"{casts:,} ({casts - model_casts:+}) | {SCRIPT_OVER_MODEL:.0%} over the model's |"
    )
    return "\n".join(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = measure()
    results["torch"] = torch.__version__
    print(table(results))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_work.json").write_text(json.dumps(results, indent=2) + "\n")
