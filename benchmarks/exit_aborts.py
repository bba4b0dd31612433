"""How often finished runs die at interpreter exit; how many threads outlive destroy_process_group.

    python benchmarks/exit_aborts.py  # 200 launches, 4 at a time: about 25 minutes on 2 cores
    python benchmarks/exit_aborts.py --launches 100 --parallel 4
    # the scripts of another checkout (a fix on trial)
    python benchmarks/exit_aborts.py --root /tmp/copy

Launches, round robin, the three training scripts (`python -m torch.distributed.run --standalone
--nproc-per-node=2 train_X.py --dataset synthetic --max-steps 3 --no-eval --metrics <temp file>`, so
all_gather_object runs last) and each snippet in docs/snippets (the command on its docstring's Run:
line, without the optional [...] part), --parallel at a time: the load makes the race below
likelier. A launch is unexpected if torchrun exits with another code than the script's (0 for all
here); a rank that died by a signal is named by it (SIGABRT: "terminate called without an active
exception"; a SIGTERM beside it is torchrun stopping the other rank).

The race: a gloo worker thread lets go of the last collective's work (and its tensors) just after
the collective returns. If the process group is still alive when Python shuts down, that thread can
need the GIL during Py_FinalizeEx, and the process aborts. The group's C++ object, and its threads,
end only when its last reference goes; destroy_process_group() drops torch's own. So each rank runs
under a wrapper that counts its native threads (/proc/self/task; gloo's are named pt_gloo_runloop
and gloo_tcp_loop) before init_process_group, right after destroy_process_group, and at exit (the
last atexit handler, just before the interpreter's teardown), then runs the script unchanged
(runpy). Prints a table per script ("-": that moment never came, as in a script ending with
os._exit) and writes JSON (--out), every launch's figures included.
"""

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TRAINING = ("train_ddp.py", "train_fsdp.py", "train_pippy.py")
EXPECTED = {}  # script name: its exit code, where not 0

# Runs as the torchrun script: argv is the real script and its arguments.
WRAPPER = r"""
import atexit, os, runpy, sys
import torch.distributed as dist
from torch.distributed import distributed_c10d

def tag(when):  # one line per moment: rank, moment, all native threads, gloo's
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # a thread that just ended
            pass
    gloo = sum(name.startswith(("pt_gloo", "gloo")) for name in names)
    # one write: whole
    os.write(1, f"@threads {os.environ.get('RANK')} {when} {len(names)} {gloo}\n".encode())

def patched(real, before, after):
    def call(*args, **kwargs):
        before and tag(before)
        result = real(*args, **kwargs)
        after and tag(after)
        return result
    return call

for module in (dist, distributed_c10d):  # the scripts call dist.X; torch calls distributed_c10d.X
    module.init_process_group = patched(distributed_c10d.init_process_group, "before_init", None)
    module.destroy_process_group = patched(
        distributed_c10d.destroy_process_group, None, "after_destroy"
    )
atexit.register(tag, "at_exit")  # registered first, so it runs last
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script` would have it
runpy.run_path(script, run_name="__main__")
"""


def snippet_command(path):
    """(environment, arguments) from the docstring's `Run:  [VAR=value ...] torchrun ... NAME.py
    [args]`."""
    line = next((t for t in path.read_text().splitlines() if t.startswith("Run:")), None)
    if line is None or "torchrun" not in line:
        return None
    words = shlex.split(line[4:].split("(")[0].split("[")[0])
    start = words.index("torchrun")
    env = dict(w.split("=", 1) for w in words[:start])
    script = next(i for i, w in enumerate(words) if w.endswith(".py"))
    return env, words[start + 1 : script], words[script + 1 :]


def jobs(root):
    """[(name, env, torchrun flags, script path, script args)]; {tmp} and {n}: a temporary folder,
    the launch."""
    found = []
    for name in TRAINING:
        args = [
            "--dataset",
            "synthetic",
            "--max-steps",
            "3",
            "--no-eval",
            "--metrics",
            "{tmp}/{n}.json",
        ]
        found.append((name, {}, ["--standalone", "--nproc-per-node=2"], root / name, args))
    for path in sorted((root / "docs" / "snippets").glob("*.py")):
        command = snippet_command(path)
        if command:
            found.append((path.name, command[0], command[1], path, command[2]))
    return found


def descendants(pid):
    """Every process below ``pid`` (torchrun starts each worker in a session of its own)."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(
                    int(entry)
                )
        except (OSError, IndexError, ValueError):
            pass
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return sorted(set(found))


def launch(number, job, root, temporary, timeout):
    name, extra_env, flags, script, args = job
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(root),
        CUDA_VISIBLE_DEVICES="",
        **extra_env,
    )
    env.pop("RANK", None)  # in case this runs under a launcher itself
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *flags,
        os.path.join(temporary, "count_threads.py"),
        str(script),
        *[a.replace("{tmp}", temporary).replace("{n}", str(number)) for a in args],
    ]
    started = time.monotonic()
    job_process = subprocess.Popen(
        command,
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = job_process.communicate(timeout=timeout)
        code = job_process.returncode
    except subprocess.TimeoutExpired:
        for pid in [
            *descendants(job_process.pid),
            job_process.pid,
        ]:  # the workers too, or they run on
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        output, code = job_process.communicate()[0], "timeout"
    text = output.decode(errors="replace")
    threads = {}  # (rank, moment): (all, gloo's); the last destroy_process_group of a rank counts
    for rank, when, total, gloo in re.findall(r"^@threads (\d+) (\w+) (\d+) (\d+)$", text, re.M):
        threads[f"{rank} {when}"] = [int(total), int(gloo)]
    # torchrun's summary names each failed rank's exit code; a negative one is the signal that ended
    # it
    rank_codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", text)]
    return {
        "script": name,
        "code": code,
        "rank_codes": rank_codes,
        "seconds": round(time.monotonic() - started, 1),
        "terminate_lines": text.count("terminate called"),
        "threads": threads,
        "tail": text[-1500:] if code != EXPECTED.get(name, 0) else "",
    }


def why(record):
    """Why a launch was unexpected, in words: SIGABRT, exit code 1, timeout."""
    signals = [signal.Signals(-c).name for c in record["rank_codes"] if c < 0]
    return ", ".join(sorted(set(signals))) or (
        f"exit code {record['code']}" if record["code"] != "timeout" else "timeout"
    )


def figure(records, when, index):
    """Median over launches of the rank's larger count at that moment, and the largest seen."""
    values = [
        max(r["threads"][k][index] for k in r["threads"] if k.endswith(" " + when))
        for r in records
        if any(k.endswith(" " + when) for k in r["threads"])
    ]
    return (statistics.median(values), max(values)) if values else (None, None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--launches", type=int, default=200, help="launches in all, shared round robin"
    )
    parser.add_argument(
        "--parallel", type=int, default=4, help="launches running at once: the load"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one launch may take")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose scripts run")
    parser.add_argument("--only", nargs="*", help="script names to launch (default: all)")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "exit_aborts.json"
    )
    args = parser.parse_args()
    root = args.root.resolve()
    chosen = [j for j in jobs(root) if not args.only or j[0] in args.only]
    plan = [(n, chosen[n % len(chosen)]) for n in range(args.launches)]
    records = []
    with tempfile.TemporaryDirectory() as temporary:
        Path(temporary, "count_threads.py").write_text(WRAPPER)
        with ThreadPoolExecutor(args.parallel) as pool:
            for record in pool.map(
                lambda p: launch(p[0], p[1], root, temporary, args.timeout), plan
            ):
                records.append(record)
                if record["code"] != EXPECTED.get(record["script"], 0):
                    print(
                        f"launch {len(records)}: {record['script']} unexpected "
                        f"({why(record)}):\n{record['tail']}",
                        flush=True,
                    )
    print(
        f"\n{args.launches} launches, {args.parallel} at a time, torch {torch.__version__}, "
        f"{os.cpu_count()} cores,"
        f" root {args.root}\nthreads: median over launches of the larger rank's count (max), all "
        "of them / gloo's\n"
    )
    print(
        "| script | launches | unexpected exits | threads before init | after destroy | at exit "
        "| gloo's after destroy | gloo's at exit | command |\n|" + " --- |" * 9
    )
    summary = {}
    for name, extra_env, flags, script, script_args in chosen:
        mine = [r for r in records if r["script"] == name]
        bad = [why(r) for r in mine if r["code"] != EXPECTED.get(name, 0)]
        counts = {reason: bad.count(reason) for reason in sorted(set(bad))}
        figures = {
            f"{when}{'_gloo' if index else ''}": figure(mine, when, index)
            for index in (0, 1)
            for when in ("before_init", "after_destroy", "at_exit")
        }
        command = " ".join(
            [
                *(f"{k}={v}" for k, v in extra_env.items()),
                "torchrun",
                *flags,
                os.path.relpath(script, root),
                *script_args,
            ]
        ).replace("{tmp}/{n}", "$TMP/N")
        summary[name] = {
            "launches": len(mine),
            "unexpected": counts,
            "threads": figures,
            "command": command,
            "terminate_lines": sum(r["terminate_lines"] for r in mine),
            "median_seconds": statistics.median(r["seconds"] for r in mine) if mine else None,
        }
        cell = lambda pair: "-" if pair[0] is None else f"{pair[0]:g} ({pair[1]})"  # noqa: E731
        print(
            f"| {name} | {len(mine)} | {len(bad)}{' ' + str(counts) if counts else ''} | "
            + " | ".join(
                cell(figures[k])
                for k in (
                    "before_init",
                    "after_destroy",
                    "at_exit",
                    "after_destroy_gloo",
                    "at_exit_gloo",
                )
            )
            + f" | `{command}` |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "launches": args.launches,
                "parallel": args.parallel,
                "root": str(args.root),
                "torch": torch.__version__,
                "cores": os.cpu_count(),
                "scripts": summary,
                "records": records,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
