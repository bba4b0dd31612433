"""How reliably a copy restarts: the README's copy recipe (tests/test_template.py makes it, as the
README says), run as the README says (`bash launch.sh train_ddp.py`, 2 CPU processes,
MAX_RESTARTS=1), each run's rank 1 killed with SIGKILL after its first checkpoint. Counts the runs
that restarted, finished and ended with bitwise the weights (BatchNorm's running statistics
included) of a run never killed. Prints a JSON line.

    python benchmarks/copy_restarts.py              # 20 kills of train_ddp.py
    python benchmarks/copy_restarts.py --kills 5 --script train_fsdp.py
    python benchmarks/copy_restarts.py --plain  # the plain torchrun command instead of launch.sh

Before each attempt's store had a prefix of its own (failures.process_group_options), a copy
without the launcher failed about half its restarts: pytorch issue 135712.
"""

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
from conftest import Run, launcher_env, load_weights, max_difference, wait_for, worker_pids  # noqa: E402
from test_template import copy_command, copy_section, make_copy  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--kills", type=int, default=20)
parser.add_argument("--script", default="train_ddp.py", choices=("train_ddp.py", "train_fsdp.py"))
parser.add_argument(
    "--plain", action="store_true", help="the README's plain torchrun command, not launch.sh"
)
args = parser.parse_args()


def command():
    if not args.plain:
        return [arg.replace("train_ddp.py", args.script) for arg in copy_command()]
    plain = re.search(r"`(torchrun [^`]*train_ddp\.py[^`]*)`", copy_section()).group(1).split()
    plain = [arg.replace("train_ddp.py", args.script) for arg in plain]
    return [sys.executable, "-m", "torch.distributed.run", "--max-restarts=1", *plain[1:]]


def main():
    with tempfile.TemporaryDirectory() as home:
        project, _ = make_copy(Path(home), [args.script])
        env = launcher_env(NPROC_PER_NODE=2, MAX_RESTARTS=1, PYTHONPATH=project)
        common = [*command(), "--log-every", "10", "--checkpoint-every", "20", "--no-eval"]
        never = Run(
            [*common, "--checkpoint-dir", "never", "--save", "never.pt"], env=env, cwd=project
        ).wait()
        if never.returncode:
            sys.exit(f"copy_restarts.py: the run never killed failed:\n{never.output[-3000:]}")
        reference, outcomes, started = load_weights(project / "never.pt"), [], time.monotonic()
        for kill in range(args.kills):
            run = Run(
                [*common, "--checkpoint-dir", f"k{kill}", "--save", f"k{kill}.pt"],
                env=env,
                cwd=project,
            )
            wait_for(project / f"k{kill}" / "step-20", run)
            os.kill(worker_pids(run.process.pid)[1], signal.SIGKILL)
            run.wait()
            if run.returncode:
                outcome = f"exit code {run.returncode}: {run.output.strip().splitlines()[-1][:200]}"
            elif "resumed from" not in run.output:
                outcome = "finished without a restart"
            elif max_difference(load_weights(project / f"k{kill}.pt"), reference) != 0:
                outcome = "restarted, but other weights"
            else:
                outcome = "restarted, bitwise"
            outcomes.append(outcome)
            print(f"kill {kill + 1}: {outcome}", file=sys.stderr, flush=True)
    print(
        json.dumps(
            {
                "script": args.script,
                "launcher": "torchrun" if args.plain else "launch.sh",
                "kills": args.kills,
                "restarted_bitwise": outcomes.count("restarted, bitwise"),
                "outcomes": outcomes,
                "seconds": round(time.monotonic() - started),
            }
        )
    )


if __name__ == "__main__":
    main()
