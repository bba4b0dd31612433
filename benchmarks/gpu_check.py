"""The steps of the GPU check: benchmarks/gpu_check.sh runs each one under its own timeout.

    python3 benchmarks/gpu_check.py step NAME OUT --budget SECONDS [--dry-run]
    python3 benchmarks/gpu_check.py verify OUT     # after a dry run: every recorded command parses
    python3 benchmarks/gpu_check.py summary OUT [--dry-run]

A step writes OUT/NAME.json (its rows and the commands it ran) after every row, so a step killed by
its timeout still leaves the rows it finished. With --dry-run a step runs nothing: it records its
commands, pretends each succeeded, with --metrics files of the real shape (so that the code reading
them runs too), and `verify` parses every recorded command with the script's own parser.
"""

import argparse
import ast
import contextlib
import importlib.metadata
import importlib.util
import io
import json
import os
import platform
import re
import runpy
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable  # gpu_check.sh's $PYTHON: the one with torch
NANOGPT_LOSS = 1.4697  # nanoGPT's char-level Shakespeare, 6 layers x 384 wide: validation loss
GPT_STEPS = 1000  # of nanoGPT's 5,000 (its cosine over these): what fits the gpt step's budget
SPEED_STEPS = 600  # per speed run: compare.py's GPU runs take 1000, which would not fit 9 minutes
MARGIN = 4  # seconds a step keeps back from its budget to kill what runs and write its rows
NEEDS_TWO = [  # (what, what it needs, why one GPU cannot run it)
    ("DDP on 2+ ranks", "2+ GPUs", "NCCL's gradient all-reduce between GPUs: one rank has no peer"),
    ("FSDP on 2+ ranks", "2+ GPUs", "parameters sharded across GPUs: all-gather, reduce-scatter"),
    ("pipeline, 2 stages on 2 GPUs", "2+ GPUs", "activations sent between GPUs (step 2: on one)"),
    ("train_tp.py --tp 2 (its default)", "2+ GPUs", "each layer split across 2 GPUs: all-reduces"),
    ("a killed rank among live ones", "2+ GPUs", "NCCL's watchdog, torchrun's restart: a survivor"),
    ("2+ nodes", "2+ nodes", "NCCL between nodes, launch.sh's rendezvous across them"),
]


def steady_state(metrics, log_every=20):
    """compare.py's own steady_state, taken from its source: importing compare.py imports torch (2 s
    a step, in a dry run too), which this function does not use."""
    source = (ROOT / "benchmarks" / "compare.py").read_text()
    node = next(
        n
        for n in ast.parse(source).body
        if isinstance(n, ast.FunctionDef) and n.name == "steady_state"
    )
    scope = {}
    exec(compile(ast.Module(body=[node], type_ignores=[]), "compare.py", "exec"), scope)  # noqa: S102
    return scope["steady_state"](metrics, log_every)


def is_python(word):
    return re.fullmatch(r"python[\d.]*", Path(word).name) is not None


def show(argv, out):
    """A command as a person types it: python3, and OUT for the output directory."""
    words = ["python3" if i == 0 and is_python(a) else str(a) for i, a in enumerate(argv)]
    return " ".join(shlex.quote(word) for word in words).replace(str(out), "OUT")


def descendants(pid):
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            pass
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


class Launch:
    def __init__(self, name, check, argv, process, log):
        self.name, self.check, self.argv, self.process, self.log = name, check, argv, process, log
        self.returncode, self.timed_out = None, False
        self.started, self.seconds = time.monotonic(), 0.0

    @property
    def output(self):
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self):
        """SIGKILL the launch and all below it (pytest's workers, torchrun's: each in a session)."""
        if self.process is None or self.process.poll() is not None:
            return
        for pid in [*descendants(self.process.pid), self.process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()


class Step:
    def __init__(self, name, out, budget, dry):
        self.name, self.out, self.budget, self.dry = name, Path(out).resolve(), budget, dry
        self.began = time.monotonic()
        self.deadline = self.began + budget - MARGIN
        self.rows, self.commands, self.running = [], [], []
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        (self.out / "runs").mkdir(exist_ok=True)
        signal.signal(signal.SIGTERM, self._terminated)  # gpu_check.sh's timeout, or its Ctrl-C

    def _terminated(self, number, frame):
        for launch in self.running:
            launch.kill()
            self.row(
                launch.check,
                show(launch.argv, self.out),
                "timed out",
                f"killed: the step's {self.budget} s ran out, or the check was stopped",
            )
        sys.exit(124)

    def left(self):
        return self.deadline - time.monotonic()

    def start(self, name, check, argv, env=None, always=False):
        """Start ``argv`` in the repository, its output in OUT/logs/NAME.log; in a dry run, pretend,
        unless it runs ``always`` (it needs no GPU)."""
        argv = [str(a) for a in argv]
        self.commands.append({"argv": argv, "env": env or {}})
        log = self.out / "logs" / f"{name}.log"
        if (always or not self.dry) and self.left() < 1:  # its time is spent: not started
            launch = Launch(name, check, argv, None, log)
            launch.timed_out = True
            return launch
        if self.dry and not always:
            log.write_text(pretend(argv))
            launch = Launch(name, check, argv, None, log)
            launch.returncode = 0
            return launch
        # One thread per process, as compare.py runs them: the GPU does the work.
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        child_env.pop("RANK", None)  # the check may itself run under a launcher
        with open(log, "w") as file:
            process = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=child_env,
                stdout=file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        launch = Launch(name, check, argv, process, log)
        self.running.append(launch)
        return launch

    def wait(self, launch):
        if launch.process is not None:
            try:
                launch.returncode = launch.process.wait(timeout=max(self.left(), 0.1))
            except subprocess.TimeoutExpired:
                launch.kill()
                launch.timed_out = True
            self.running.remove(launch)
        launch.seconds = time.monotonic() - launch.started
        return launch

    def run(self, name, check, argv, env=None, always=False):
        return self.wait(self.start(name, check, argv, env, always))

    def failed(self, launch, expect=None):
        """A row for a launch that timed out, failed or lacks ``expect`` in its output, or None."""
        command, log = show(launch.argv, self.out), f"log: logs/{launch.name}.log"
        if launch.timed_out and launch.process is None:
            return self.row(
                launch.check,
                command,
                "timed out",
                f"not started: the step's {self.budget} s were spent",
            )
        if launch.timed_out:
            return self.row(
                launch.check,
                command,
                "timed out",
                f"after {launch.seconds:.0f} s, all the step had left; {log}",
                launch.seconds,
            )
        if launch.returncode != 0 or (expect and not self.dry and expect not in launch.output):
            why = last_error(launch.output) if launch.returncode else f"no {expect!r} in its output"
            return self.row(
                launch.check,
                command,
                "failed",
                f"exit code {launch.returncode}: {why}; {log}",
                launch.seconds,
            )
        return None

    def row(self, check, command, status, figures="", seconds=None):
        self.rows.append(
            {
                "step": self.name,
                "check": check,
                "command": command,
                "status": status,
                "figures": figures,
                "seconds": seconds,
            }
        )
        self.save()
        return self.rows[-1]

    def save(self):
        record = {
            "step": self.name,
            "dry_run": self.dry,
            "budget": self.budget,
            "seconds": time.monotonic() - self.began,
            "rows": self.rows,
            "commands": self.commands,
        }
        temporary = self.out / f".{self.name}.json"
        temporary.write_text(json.dumps(record, indent=2) + "\n")
        temporary.replace(self.out / f"{self.name}.json")  # never half a file, even if killed


def last_error(output):
    """The line that says why a run failed: the project's `error:` line, else the last line."""
    lines = [line for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if re.sub(r"^\[rank\d+\]: ?", "", line).startswith("error:")]
    return (errors or lines or [""])[-1][:300]


def pretend(argv):
    """A dry run's stand-in for a command's output, and for its --metrics file, in their shapes."""

    def value(flag, default):
        return int(argv[argv.index(flag) + 1]) if flag in argv else default

    if "--metrics" in argv:
        steps, batch = value("--max-steps", 200), value("--batch-size", 64)
        curve = [[s, 2.0 / s, s / 1000] for s in range(20, steps + 1, 20)]
        Path(argv[argv.index("--metrics") + 1]).write_text(
            json.dumps(
                {
                    "steps": steps,
                    "global_batch_size": batch,
                    "train_seconds": steps / 1000,
                    "loss_curve": curve,
                    "samples_per_second": batch * 1000.0,
                    "final_train_loss": curve[-1][1],
                    "test_loss": 0.05,
                    "test_accuracy": 0.99,
                    "mfu": None,
                    "ranks": [{"rank": 0, "peak_memory_bytes": 2**20}],
                }
            )
        )
    if any(a.endswith("bare_loop.py") for a in argv):
        return json.dumps({"samples_per_second": 1000.0, "seconds": 1.0}) + "\n"
    return "dry run: not run\n"


def metrics_of(path):
    return json.loads(Path(path).read_text())


def rate(value):
    return f"{value:,.0f} samples/s" if value else "n/a"


# ---- the steps ----


def step_env(step):
    """Torch, CUDA, the GPU, the commit and the date; without a GPU (not dry), the check stops."""
    commit = "unknown"
    if (ROOT / ".git").exists():
        with contextlib.suppress(OSError, subprocess.SubprocessError):

            def git(*args):
                return subprocess.run(
                    ["git", *args],
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    timeout=10,
                    check=False,
                ).stdout.strip()

            commit = git("rev-parse", "--short", "HEAD") or "unknown"
            if commit != "unknown" and git("status", "--porcelain", "--untracked-files=no"):
                commit += " (with uncommitted changes)"
    env = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit,
        "python": platform.python_version(),
        "host_cores": os.cpu_count(),
    }
    if step.dry:  # torch's version without importing it: a dry run stays quick
        env.update(torch=importlib.metadata.version("torch"), cuda=None, gpu="none (dry run)")
    else:
        try:
            import torch
        except ImportError as error:
            sys.exit(f"error: {PYTHON} cannot import torch ({error}): set PYTHON to one that can")
        if not torch.cuda.is_available():
            sys.exit(
                "error: torch sees no CUDA GPU (torch.cuda.is_available() is False): run it "
                "on a machine with an NVIDIA GPU, or check its commands with --dry-run"
            )
        try:
            env.update(
                torch=torch.__version__,
                cuda=torch.version.cuda,
                gpu=torch.cuda.get_device_name(0),
                gpus=torch.cuda.device_count(),
                cudnn=torch.backends.cudnn.version(),
            )
        except RuntimeError as error:  # a driver too old for this torch's CUDA, say
            sys.exit(f"error: CUDA does not start: {' '.join(str(error).split())[:300]}")
    (step.out / "machine.json").write_text(json.dumps(env, indent=2) + "\n")
    step.save()


def step_pytest(step):
    # 4 workers taking single tests (--dist load; pytest.ini's loadfile would give one the whole
    # file): each test's launches are mostly start-up, and the GPU has room for 4 at a time.
    launch = step.run(
        "pytest",
        "tests/test_gpu.py",
        [
            PYTHON,
            "-m",
            "pytest",
            "tests/test_gpu.py",
            "-n",
            "4",
            "--dist",
            "load",
            "-v",
            "--junitxml",
            step.out / "pytest.xml",
        ],
    )
    outcomes = {}  # test: PASSED, FAILED, ERROR or SKIPPED, from -v's lines (with xdist or without)
    for line in launch.output.splitlines():
        match = re.search(
            r"\b(PASSED|FAILED|ERROR|SKIPPED)\b.*?(tests/test_gpu\.py::\S+)", line
        ) or re.search(r"(tests/test_gpu\.py::\S+) (PASSED|FAILED|ERROR|SKIPPED)\b", line)
        if match:
            word, test = sorted(match.groups(), key=lambda group: group.startswith("tests/"))
            outcomes[test.split("::", 1)[1]] = word
    counts = ", ".join(
        f"{list(outcomes.values()).count(word)} {word.lower()}"
        for word in ("PASSED", "FAILED", "ERROR", "SKIPPED")
        if word in outcomes.values()
    )
    if not step.failed(launch):
        step.row(launch.check, show(launch.argv, step.out), "ok", counts, launch.seconds)
    elif outcomes:  # its row is written: say which tests failed
        bad = ", ".join(test for test, word in outcomes.items() if word in ("FAILED", "ERROR"))
        step.rows[-1]["figures"] = f"{counts}; failed: {bad or 'none'}; {step.rows[-1]['figures']}"
        step.save()


QUICK = [  # (check, launcher and flags): the README's quick start, one process on one GPU
    ("train_ddp.py, 1 rank", ["run_ddp.sh"]),
    ("train_fsdp.py, 1 rank", ["run_fsdp.sh"]),
    ("train_pippy.py, 1 rank, 1 stage", ["run_pippy.sh"]),
    # --no-eval: the script refuses the forward-only evaluation of two neighbouring stages on a rank
    (
        "train_pippy.py, 1 rank, 2 stages (interleaved-1f1b)",
        ["run_pippy.sh", "--schedule", "interleaved-1f1b", "--epochs", "1", "--no-eval"],
    ),
    ("train_tp.py --tp 1", ["run_tp.sh", "--tp", "1"]),
]


def step_quick(step):
    # All at once: they show that each script learns on a GPU, not how fast, and so fit the budget.
    launches = []
    for number, (check, (launcher, *flags)) in enumerate(QUICK):
        metrics = step.out / "runs" / f"quick-{number}.json"
        argv = ["bash", launcher, *flags, "--device", "cuda", "--metrics", metrics]
        launch = step.start(f"quick-{number}", check, argv, {"NPROC_PER_NODE": "1"})
        launches.append((metrics, launch))
    for metrics, launch in launches:
        if step.failed(step.wait(launch), expect="(nccl, cuda)"):
            continue
        m = metrics_of(metrics)
        curve = [loss for _, loss, _ in m["loss_curve"]]
        if m["test_accuracy"] is None:  # not evaluated: the training loss must have fallen
            learned = curve[-1] < curve[0] / 2
            figures = f"train loss {curve[0]:.3f} to {curve[-1]:.3f} in {m['steps']} steps"
        else:
            accuracy = m["test_accuracy"]
            learned = accuracy > 0.9
            figures = f"test accuracy {accuracy:.2%} after {m['steps']} steps (chance 10%)"
        peak = max(r["peak_memory_bytes"] for r in m["ranks"]) / 2**20
        step.row(
            launch.check,
            show(launch.argv, step.out),
            "ok" if learned else "failed",
            f"{figures}; {rate(m['samples_per_second'])} whole run, {len(QUICK)} runs sharing "
            f"the GPU; peak memory {peak:,.0f} MiB",
            launch.seconds,
        )


def step_speed(step):
    """compare.py's figure 6 on one GPU: the bare loop, train_ddp.py eager and --compile."""
    for batch in (64, 512):
        bare = step.run(
            f"speed-bare-{batch}",
            f"bare loop, batch {batch}",
            [
                PYTHON,
                "benchmarks/bare_loop.py",
                "--device",
                "cuda",
                "--steps",
                SPEED_STEPS,
                "--batch-size",
                batch,
            ],
        )
        bare_rate = eager = None  # without the bare loop's figure, train_ddp.py's still count
        if not step.failed(bare):
            bare_rate = json.loads(bare.output.strip().splitlines()[-1])["samples_per_second"]
            step.row(bare.check, show(bare.argv, step.out), "ok", rate(bare_rate), bare.seconds)
        for label in ("eager", "--compile"):
            name = f"speed-{label.strip('-')}-{batch}"
            metrics = step.out / "runs" / f"{name}.json"
            argv = [
                PYTHON,
                "train_ddp.py",
                "--dataset",
                "synthetic",
                "--seed",
                "0",
                "--no-eval",
                "--metrics",
                metrics,
                "--device",
                "cuda",
                "--max-steps",
                SPEED_STEPS,
                "--epochs",
                "1000",
                "--batch-size",
                batch,
            ]  # as compare.py's Bench.train
            argv += ["--compile"] if label == "--compile" else []
            launch = step.run(name, f"train_ddp.py {label}, batch {batch}", argv)
            if step.failed(launch):
                continue
            m = metrics_of(metrics)
            steady = steady_state(m)[1]
            figures = f"{rate(steady)} steady ({rate(m['samples_per_second'])} whole run)"
            if steady and label == "eager":
                eager = steady
                if bare_rate:
                    ratio = steady / bare_rate
                    figures += f"; {ratio:.2f} × the bare loop {target(ratio, 0.95)}"
            elif steady and eager:
                figures += f"; {steady / eager:.2f} × eager {target(steady / eager, 1.0)}"
            step.row(launch.check, show(argv, step.out), "ok", figures, launch.seconds)


def target(value, least, words=None):
    """Whether a figure met its target, in words: "(target ≥ 0.95: met)"."""
    met = "met" if value >= least else "not met"
    return f"(target {words or f'≥ {least:g}'}: {met})"


def step_gpt(step):
    """The transformer rung (issue 43) at nanoGPT's GPU size against its validation loss: the
    recipe of --model gpt-gpu (6 layers, 6 heads, 384 wide, context 256, dropout 0.2; batch 64, lr
    1e-3, 100 warmup steps, clipped at 1), shortened to GPT_STEPS of its 5,000 steps."""
    check = (
        f"--model gpt-gpu (nanoGPT's size and recipe), shortened to {GPT_STEPS:,} of its 5,000 "
        f"steps, beside nanoGPT's {NANOGPT_LOSS} after 5,000"
    )
    helped = step.run("gpt-help", check, [PYTHON, "train_ddp.py", "--help"], always=True)
    if step.failed(helped):
        return
    if not re.search(r"--model \{[^}]*\bgpt-gpu\b", helped.output):  # --model {cnn,gpt,gpt-gpu}
        step.row(
            check,
            show(helped.argv, step.out),
            "not run: no GPT at nanoGPT's size in this commit (issue 43)",
            "train_ddp.py --help has no --model gpt-gpu",
        )
        return
    metrics = step.out / "runs" / "gpt.json"
    argv = [
        PYTHON,
        "train_ddp.py",
        "--model",
        "gpt-gpu",
        "--device",
        "cuda",
        "--precision",
        "bf16",
        "--max-steps",
        GPT_STEPS,
        "--metrics",
        metrics,
    ]
    launch = step.run("gpt", check, argv)
    if not step.failed(launch):
        m = metrics_of(metrics)
        step.row(
            launch.check,
            show(argv, step.out),
            "ok",
            f"validation loss {m['test_loss']:.4f} after {GPT_STEPS:,} steps (nanoGPT: "
            f"{NANOGPT_LOSS} after 5,000); {m['train_seconds']:.1f} s of training, "
            f"{1000 * m['train_seconds'] / GPT_STEPS:.1f} ms a step "
            f"{target(15, 1000 * m['train_seconds'] / GPT_STEPS, 'at most 15 ms')}",
            launch.seconds,
        )


def step_bf16(step):
    """bf16 autocast against fp32: train_ddp.py's defaults on the bundled MNIST, an epoch each."""
    results = {}
    for precision in ("fp32", "bf16"):
        metrics = step.out / "runs" / f"precision-{precision}.json"
        argv = [
            PYTHON,
            "train_ddp.py",
            "--device",
            "cuda",
            "--epochs",
            "1",
            "--precision",
            precision,
            "--metrics",
            metrics,
        ]
        check = f"train_ddp.py {precision}, batch 64, 1 epoch"
        launch = step.run(f"precision-{precision}", check, argv)
        if step.failed(launch):
            continue
        m = results[precision] = metrics_of(metrics)
        m["steady"] = steady_state(m)[1]
        mfu = f"; MFU {m['mfu']:.2%}" if m.get("mfu") else ""
        step.row(
            check,
            show(argv, step.out),
            "ok",
            f"{rate(m['steady'])} steady; train loss {m['final_train_loss']:.4f}, test loss "
            f"{m['test_loss']:.4f}, test accuracy {m['test_accuracy']:.2%}{mfu}",
            launch.seconds,
        )
    if len(results) == 2 and results["fp32"]["steady"] and results["bf16"]["steady"]:
        fp32, bf16 = results["fp32"], results["bf16"]
        difference = 100 * (bf16["test_accuracy"] - fp32["test_accuracy"])
        step.row(
            "bf16 against fp32",
            "",
            "ok",
            f"{bf16['steady'] / fp32['steady']:.2f} × fp32's "
            f"samples/s; test accuracy {difference:+.2f} points",
        )


def step_resume(step):
    """SIGTERM mid-run through the launcher, the same command again: a whole run's weights?"""

    def command(name):
        return [
            "bash",
            "run_ddp.sh",
            "--device",
            "cuda",
            "--epochs",
            "2",
            "--max-steps",
            "1100",
            "--checkpoint-every",
            "100",
            "--checkpoint-dir",
            step.out / "runs" / f"{name}-ck",
            "--save",
            step.out / "runs" / f"{name}.pt",
            "--deterministic",  # else no GPU run repeats itself bit for bit
        ]

    one = {"NPROC_PER_NODE": "1"}
    # At once: two runs never stopped (does the GPU repeat itself bit for bit?) and the one to stop,
    # which its checkpoint of step 100 shows to be mid-run (1,100 steps cross an epoch's end).
    runs = {
        name: step.start(f"resume-{name}", check, command(name), one)
        for name, check in (
            ("never", "a run never stopped"),
            ("again", "the same, again"),
            ("stopped", "SIGTERM mid-run, through the launcher"),
        )
    }
    stopped, signalled = runs["stopped"], False
    while stopped.process and stopped.process.poll() is None and step.left() > 0:
        if (step.out / "runs" / "stopped-ck" / "step-100").exists():
            os.kill(stopped.process.pid, signal.SIGTERM)  # launch.sh execs torchrun: its process
            signalled = True
            break
        time.sleep(0.02)
    for launch in runs.values():
        step.wait(launch)
    if step.failed(runs["never"]) or step.failed(runs["again"]):
        return
    said = re.search(r"stopped by SIGTERM at step (\d+ of \d+)", stopped.output)
    if stopped.timed_out:
        step.failed(stopped)
        return
    if not step.dry and not (signalled and stopped.returncode == 143 and said):
        step.row(
            stopped.check,
            show(stopped.argv, step.out),
            "failed",
            f"exit code {stopped.returncode} (143 expected), signalled: {signalled}; "
            f"{last_error(stopped.output)}",
            stopped.seconds,
        )
        return
    at = said.group(1) if said else "N of M"
    step.row(
        stopped.check,
        show(stopped.argv, step.out),
        "ok",
        f"stopped at step {at}, exit code 143, checkpointed",
        stopped.seconds,
    )
    resumed = step.run(
        "resume-resumed",
        "the same command again, against the run never stopped",
        command("stopped"),
        one,
    )
    if step.failed(resumed, expect="resumed from"):
        return
    if step.dry:
        step.row(resumed.check, show(resumed.argv, step.out), "ok", "", resumed.seconds)
        return
    import torch

    def apart(a, b):  # (bitwise equal?, the largest difference of any weight)
        x, y = (torch.load(step.out / "runs" / f"{n}.pt", weights_only=True) for n in (a, b))
        if x.keys() != y.keys():
            return False, float("inf")
        differences = [(x[k].double() - y[k].double()).abs().max().item() for k in x]
        return all(torch.equal(x[k], y[k]) for k in x), max(differences)

    same, difference = apart("stopped", "never")
    repeats, noise = apart("again", "never")
    repeat = (
        "a repeat of the run never stopped is bitwise equal to it"
        if repeats
        else f"a repeat of the run never stopped differs too, by up to {noise:.1e}: the GPU varies"
    )
    if same:
        status, figures = "ok", f"bitwise equal, resumed at step {at.split()[0]}; {repeat}"
    else:  # a GPU that does not repeat itself cannot show an exact resume
        status = "failed" if repeats else "warning"
        figures = f"not bitwise equal: up to {difference:.1e} apart; {repeat}"
    step.row(resumed.check, show(resumed.argv, step.out), status, figures, resumed.seconds)


STEPS = {
    "env": step_env,
    "pytest": step_pytest,
    "quick": step_quick,
    "speed": step_speed,
    "gpt": step_gpt,
    "bf16": step_bf16,
    "resume": step_resume,
}
TITLES = {
    "pytest": "1. tests/test_gpu.py",
    "quick": "2. quick start, one GPU",
    "speed": "3. speed against the bare loop",
    "gpt": "4. transformer rung",
    "bf16": "5. bf16 against fp32",
    "resume": "6. kill and exact resume",
}


# ---- a dry run's proof: every command parses ----


class _Parsed(Exception):
    pass


def parser_of(script):
    """The argparse parser ``script`` builds, taken at its parse_args call (the script stops there),
    as tests/test_docs.py takes it: one process for all the scripts, not one each."""

    def capture(self, args=None, namespace=None):
        raise _Parsed(self)

    saved = argparse.ArgumentParser.parse_args, sys.argv[:], sys.path[:]
    argparse.ArgumentParser.parse_args = capture
    sys.argv, sys.path[:0] = [str(ROOT / script)], [str((ROOT / script).parent)]
    try:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    except _Parsed as parsed:
        return parsed.args[0]
    finally:
        argparse.ArgumentParser.parse_args, sys.argv, sys.path[:] = saved
    raise RuntimeError(f"{script} finished without parsing any arguments")


def problems_with(argv, parsers):
    """What is wrong with one recorded command, a line each: [] when it would start as written."""
    if is_python(argv[0]) and argv[1:3] == ["-m", "pytest"]:
        missing = [p for p in ("xdist", "pytest_timeout") if importlib.util.find_spec(p) is None]
        problems = [] if (ROOT / argv[3]).exists() else [f"{argv[3]} does not exist"]
        return problems + [f"pytest plugin {p} is missing (requirements-dev.txt)" for p in missing]
    if argv[0] == "bash":
        if not (ROOT / argv[1]).exists():
            return [f"{argv[1]} does not exist"]
        found = re.search(r"launch\.sh\"?\s+(\S+\.py)", (ROOT / argv[1]).read_text())
        if not found:
            return [f"{argv[1]} does not say which script launch.sh runs"]
        script, args = found.group(1), argv[2:]
    elif is_python(argv[0]):
        script, args = argv[1], argv[2:]
    else:
        return [f"no way to check {argv[0]}"]
    if not (ROOT / script).exists():
        return [f"{script} does not exist"]
    if script not in parsers:
        parsers[script] = parser_of(script)
    accepted = parsers[script]._option_string_actions
    unknown = [a for a in args if a.startswith("--") and a.split("=", 1)[0] not in accepted]
    if unknown:  # by exact name: argparse would take a prefix
        return [f"{script} has no flag {', '.join(unknown)}"]
    from plumbing.training import UsageError  # the scripts' parser raises it, as one line

    said = io.StringIO()  # --help's text; argparse's own error line
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            parsers[script].parse_args(args)
    except SystemExit as exit:
        return [f"{script} refuses its flags: {last_error(said.getvalue())}"] if exit.code else []
    except UsageError as error:
        return [f"{script} refuses its flags: {error}"]
    return []


def verify(out):
    for name in ("TORCHELASTIC_ERROR_FILE", "RANK"):  # as a plain `python script`: errors raise
        os.environ.pop(name, None)
    sys.path.insert(0, str(ROOT))
    parsers, checked, problems = {}, 0, []
    tsv = out / "steps.tsv"
    left_out = {
        line.split("\t")[0] for line in tsv.read_text().splitlines() if "\tleft-out\t" in line
    }
    for name in STEPS:
        path = out / f"{name}.json"
        if name in left_out:  # GPU_CHECK_STEPS named the others
            continue
        if not path.exists():
            problems.append(f"step {name} wrote no {path.name}")
            continue
        for command in json.loads(path.read_text())["commands"]:
            checked += 1
            problems += [
                f"{show(command['argv'], out)}: {problem}"
                for problem in problems_with(command["argv"], parsers)
            ]
    result = {"checked": checked, "problems": problems}
    (out / "verify.json").write_text(json.dumps(result, indent=2) + "\n")
    for problem in problems:
        print(f"gpu_check: {problem}", file=sys.stderr)
    print(f"gpu_check: dry run: {checked} commands checked, {len(problems)} problem(s)")
    return 1 if problems else 0


# ---- the table ----


def summary(out, dry):
    machine = out / "machine.json"
    env = json.loads(machine.read_text()) if machine.exists() else {}
    ran = {}  # step: (exit code, budget, seconds), as gpu_check.sh wrote them
    if (out / "steps.tsv").exists():
        for line in (out / "steps.tsv").read_text().splitlines():
            name, code, budget, seconds = line.split("\t")
            ran[name] = (code, int(budget), int(seconds))
    rows, commands = [], []
    for name, title in TITLES.items():
        path = out / f"{name}.json"
        record = json.loads(path.read_text()) if path.exists() else {"rows": [], "commands": []}
        rows += [{**row, "step": title} for row in record["rows"]]
        commands += [show(command["argv"], out) for command in record["commands"]]
        code, budget, seconds = ran.get(name, ("none", 0, 0))
        timed_out = code in ("124", "137")
        if timed_out and not any(row["status"] == "timed out" for row in record["rows"]):
            rows.append(
                {
                    "step": title,
                    "check": "the step",
                    "command": "",
                    "status": "timed out",
                    "figures": f"its {budget} s ran out",
                    "seconds": seconds,
                }
            )
        elif code == "left-out":  # GPU_CHECK_STEPS named the others: a rerun of some steps
            rows.append(
                {
                    "step": title,
                    "check": "the step",
                    "command": "",
                    "status": "not run: GPU_CHECK_STEPS left it out",
                    "figures": "",
                    "seconds": None,
                }
            )
        elif not timed_out and (code != "0" or not record["rows"]):
            why = (
                "the check's time was spent"
                if code == "skipped"
                else f"the step ended with exit code {code} (see {name}.json, logs/)"
            )
            rows.append(
                {
                    "step": title,
                    "check": "the step",
                    "command": "",
                    "status": "failed",
                    "figures": why,
                    "seconds": seconds,
                }
            )
    rows += [
        {
            "step": f"needs {needs}",
            "check": what,
            "command": "",
            "status": f"not run: needs {needs}",
            "figures": why,
            "seconds": None,
        }
        for what, needs, why in NEEDS_TWO
    ]
    verified = out / "verify.json"
    verified = json.loads(verified.read_text()) if dry and verified.exists() else None
    lines = ["# GPU check", ""]
    if dry:
        checked = "The commands were not checked (verify.json is missing)."
        if verified:
            problems = len(verified["problems"])
            checked = f"{verified['checked']} commands checked, {problems} problem(s)."
        lines += [f"**A dry run: nothing ran, and nothing here is a measurement.** {checked}", ""]
    gpus = ""
    if env.get("gpus", 0) > 1:
        gpus = f" ({env['gpus']} visible: tests/test_gpu.py uses 2, every other step one)"
    lines += [
        f"- date: {env.get('date', 'unknown')}",
        f"- commit: {env.get('commit', 'unknown')}",
        f"- torch {env.get('torch')}, CUDA {env.get('cuda')}, Python {env.get('python')}",
        f"- GPU: {env.get('gpu', 'unknown')}{gpus}",
        f"- {sum(s for _, _, s in ran.values())} s of steps (a budget of about 9 minutes)",
        "",
        "| step | check | result | figures | seconds |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        ok = row["status"] == "ok"
        status = "dry run: parses" if dry and ok else row["status"]
        figures = "dry run: not measured" if dry and ok else row["figures"].replace("|", "/")
        seconds = "" if row["seconds"] is None or dry else f"{row['seconds']:.0f}"
        lines.append(f"| {row['step']} | {row['check']} | {status} | {figures} | {seconds} |")
    lines += ["", "Commands (OUT: this directory; each one's output is in logs/):", ""]
    lines += [f"- `{command}`" for command in commands]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    record = {"env": env, "dry_run": dry, "rows": rows, "commands": commands}
    (out / "summary.json").write_text(json.dumps(record, indent=2) + "\n")
    print("\n".join(lines))
    bad = [row for row in rows if row["status"] in ("failed", "timed out")]
    return 1 if bad or (dry and (not verified or verified["problems"])) else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("step", "verify", "summary"))
    parser.add_argument("name_or_out", help="the step's name (step), else OUT")
    parser.add_argument("out", nargs="?", help="OUT, for a step")
    parser.add_argument("--budget", type=int, default=60, help="seconds the step may take")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if args.what == "step":
        step = Step(args.name_or_out, args.out, args.budget, args.dry_run)
        STEPS[args.name_or_out](step)
        step.save()
        return 0
    out = Path(args.name_or_out).resolve()
    return verify(out) if args.what == "verify" else summary(out, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
