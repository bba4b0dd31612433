"""torchrun as launch.sh runs it: `python3 launch_torchrun.py [torchrun's arguments]`.

torchrun's own code, all output passing through, except how a launch ends: one line instead of
torchrun's 40- to 80-line ChildFailedError traceback.

  a bad input     the workers stopped with exit code 2 and rank 0 printed one `error:` line; if
                  torchrun stopped it before it could (another rank failed first), that line comes
                  from the failed rank's error file (plumbing/failures.run writes it) and is
                  printed here, by rank 0's node. Exit code 2, and no restart: the same input
                  would fail the same way (MAX_RESTARTS is for crashes).
  a retry         a failure that may pass on a retry (a peer lost, a collective's error or
                  timeout, an I/O error): the workers exit with code 75 and torchrun's restarts
                  (MAX_RESTARTS) retry it; when none is left, the first failed rank's one line.
                  Exit code 75.
  a restart       whatever failed, while MAX_RESTARTS allows: one line before torchrun restarts
                  the workers, from the failed attempt's notes: which rank, what, attempt k of n.
  a crash         the first failed rank's traceback, once, from its error file (the ranks that
                  failed after it, because a peer had gone, are left out), then a line naming the
                  rank. Its exit code, 1.
  a killed rank   one line: which rank, which signal (SIGKILL: often the kernel's out-of-memory
                  killer). Exit code 128 + the signal's number (137 for SIGKILL).
  a timeout       NCCL's watchdog ends a rank whose collective timed out (SIGABRT), once it has
                  written its flight recorder (launch.sh's TORCH_FR_DUMP_TEMP_FILE): one line
                  naming the collective the dump shows waiting, and where the dumps are. Exit code
                  75, retried as a collective's error is.
  a worker's stop a stop signal sent to one worker alone: the ranks stop together, as below, and
                  rank 0 says where; exit code 128 + the signal's number, as the worker's.
  a stop signal   one of failures.STOP_SIGNALS: SIGTERM, SIGINT, SIGUSR1 (SLURM's warning; torch
                  2.9's torchrun dies of it), SIGHUP, SIGQUIT: passed on to the workers, which stop
                  together within about a second of training, write a checkpoint and say where;
                  exit code 128 + the signal's number. A rank that does not stop within torchrun's
                  shutdown timeout (30 s) is named in one line before it is killed; a second signal
                  over failures.STOP_GRACE (2 s) later ends the launch at once, naming the ranks
                  that had not stopped (one sooner is the same stop, sent to several processes).
                  During start-up (torch still importing, no training yet) it is one line here
                  instead of each process's KeyboardInterrupt traceback; after the last step, the
                  run finishes and exits 0.
  no rendezvous   not all nodes joined within the join timeout: the line launch.sh passes in
                  LAUNCH_SH_NO_RENDEZVOUS. Exit code 2.

It also gives each rendezvous round a store of its own, on a port it holds from the start (below).
A copied command line works as it is with the real torchrun; only these endings differ.

What it takes from torchrun: torch.distributed.run's parse_args and run, the exceptions they raise
(ChildFailedError's ProcessFailures, SignalException, RendezvousTimeoutError), PContext.start and
SubprocessHandler.close (wrapped), two loggers by name. Private, for want of a public hook: the
agent's _monitor_workers and _remaining_restarts (no restart after a bad input), and the
rendezvous handler's _bootstrap_store_info and _shared_tcp_store_server (a store per round).
"""

# ruff: noqa: E402 (the signal handlers below come before the other imports: torch takes seconds)
import os
import signal
import sys


def stopped_during_start_up(number, frame):  # until torch is imported and our handlers are set
    print(
        f"stopped by {signal.Signals(number).name} during start-up: nothing was trained or saved",
        file=sys.stderr,
        flush=True,
    )
    # Not sys.exit: raised inside an import, importlib may swallow it; no worker exists yet.
    os._exit(128 + number)


# failures.STOP_SIGNALS, which cannot be imported before torch is (tests/test_faults.py checks
# they are the same)
for number in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(number, stopped_during_start_up)

# The handlers above come first: importing torch takes seconds.
import atexit
import glob
import json
import logging
import math
import pickle
import socket
import threading
import time

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import PContext, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

# Not main(): its @record would log the failure again.
from torch.distributed.run import parse_args, run

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder holds plumbing/
from plumbing.failures import RETRY_EXIT, STOP_GRACE, STOP_SIGNALS

# pid: (rank, when, signal name, training) of each worker torchrun signalled to stop (a stop, or a
# failed peer)
stopping = {}
received = []  # (signal, time) of the stop signals this launch received
workers = {}  # pid: Popen of each worker of the latest start
started = [0.0]  # time.time() of the latest start: a dump written since is this attempt's


def rank_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as file:
            variables = dict(v.split(b"=", 1) for v in file.read().split(b"\0") if b"=" in v)
        return variables.get(b"RANK", b"?").decode()
    except OSError:
        return "?"


def catches(pid, number):  # whether the process handles this signal itself (Linux: SigCgt)
    try:
        with open(f"/proc/{pid}/status") as file:
            mask = next(line for line in file if line.startswith("SigCgt:")).split()[1]
        return bool(int(mask, 16) >> (number - 1) & 1)
    except (OSError, StopIteration):
        return True  # cannot tell (not Linux): pass the signal on as it is


def alive(pid):  # a worker not yet reaped is a zombie: gone
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def quiet_workers(record):
    """torchrun's warnings about stopping workers and its error naming the failed one
    (multiprocessing.api): the one line at the end says them better. Debug and info lines (LOGLEVEL)
    pass."""
    return record.levelno < logging.WARNING or record.levelno >= logging.CRITICAL


def quiet_agent(record):  # the agent's warnings (agent.server.api) say only that a signal came
    return record.levelno != logging.WARNING


def ours(data):  # a note plumbing/failures.run wrote, not torch's placeholder {"message": "<NONE>"}
    return isinstance(data, dict) and isinstance(data.get("message"), str) and "exit_code" in data


def note(failure):  # what plumbing/failures.run wrote in the rank's error file: {} when nothing
    data = failure.error_file_data
    return data if ours(data) else {}


def this_attempt(failures):
    """The notes of every rank of this node in this attempt: also of those torchrun stopped before
    it saw them fail (when it sees one rank fail, the speaker may be printing the line that very
    moment; torchrun waits for it to exit)."""
    folders = {
        os.path.dirname(os.path.dirname(failure.error_file))
        for failure in failures.values()
        if os.path.isfile(failure.error_file)
    }
    notes = []
    for folder in folders:
        for path in glob.glob(os.path.join(folder, "*", "error.json")):
            try:
                with open(path) as file:
                    notes.append(json.load(file))
            except (OSError, ValueError):  # not written by plumbing/failures.run (atomic writes)
                pass
    return [n for n in notes if ours(n)]


def killed(failures):
    """{rank: failure} of the ranks killed by a signal, not one torchrun sent itself on seeing
    another rank fail (it may list those too)."""
    return {
        rank: failure
        for rank, failure in failures.items()
        if failure.exitcode < 0 and failure.pid not in stopping
    }


def first(failures):  # (rank, failure) of the first to fail: the earliest note, else the lowest
    return min(failures.items(), key=lambda item: (note(item[1]).get("time", math.inf), item[0]))


def timed_out(failures, since=None):
    """(rank, failure, what) of the first rank NCCL's watchdog ended (SIGABRT) with its flight
    recorder's dump written in this attempt: a collective's timeout, not a kill; what: the
    collective the dump shows waiting, if it tells. None if no rank was."""
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
    for rank, failure in sorted(failures.items()):
        try:
            fresh = os.path.getmtime(f"{prefix}{rank}") >= (started[0] if since is None else since)
        except (OSError, TypeError):  # no dump, or no prefix
            continue
        if fresh and failure.exitcode == -signal.SIGABRT:
            return rank, failure, waiting(f"{prefix}{rank}")
    return None


def waiting(path):
    """ " (nccl:all_reduce number 7)": the first collective a dump (torch's pickle) shows neither
    completed nor retired (gloo's all read "scheduled"), else its last; "" if it cannot tell."""
    try:
        with open(path, "rb") as file:
            entries = pickle.load(file)["entries"]  # written by this job's own workers
        pending = (e for e in entries if e.get("state") != "completed" and not e.get("retired"))
        entry = next(pending, entries[-1])
        return f" ({entry['profiling_name']} number {entry['collective_seq_id']})"
    except Exception:  # any other content: the line goes on without it
        return ""


def timeout_line(rank, failure, what):
    dumps = os.path.dirname(os.environ["TORCH_FR_DUMP_TEMP_FILE"])
    return (
        f"error: a collective timed out on rank {rank} (pid {failure.pid}) on "
        f"{socket.gethostname()}{what}: a rank stopped calling collectives or hung; each rank's "
        f"flight recorder is in {dumps} (python -m torch.distributed.flight_recorder.fr_trace "
        f"{dumps}); it may pass on a retry (exit code 75: torchrun restarts it while MAX_RESTARTS "
        "allows)"
    )


def cause(failures):
    """The failure in a few words, for the line of a restart: which rank, what ended it."""
    where = f" on {socket.gethostname()}"
    if found := timed_out(failures):
        rank, failure, what = found
        return f"rank {rank} (pid {failure.pid}){where}: a collective timed out{what}"
    if ranks := killed(failures):
        rank, failure = min(ranks.items())
        return f"rank {rank} (pid {failure.pid}){where} was killed by {failure.signal_name()}"
    rank, failure = first(failures)
    what = note(failure).get("cause") or f"exit code {failure.exitcode}"
    return f"rank {rank} (pid {failure.pid}){where}: {what}"


def ending(failures):
    """The one line (and exit code) for torchrun's failures, {global rank: ProcessFailure}: the
    failed worker's own exit code, 128 + the signal for one that a signal ended."""
    if any(failure.exitcode == 2 for failure in failures.values()):  # the same bad input
        notes = [n for n in this_attempt(failures) if n.get("exit_code") == 2]
        if not notes:  # not through plumbing/failures.run: whatever the worker printed is above
            print(f"error: rank {min(failures)} exited with code 2", file=sys.stderr)
        elif not any(n.get("said") for n in notes) and any(n.get("here") for n in notes):
            # the rank to say it is on this node, and did not
            print(next(n["message"] for n in notes if n.get("here")), file=sys.stderr)
        return 2
    where = f" on {socket.gethostname()}"
    if found := timed_out(failures):  # NCCL's watchdog, not a kill
        print(timeout_line(*found), file=sys.stderr)
        return RETRY_EXIT
    # A rank killed: the others failed because it had gone, and their errors say only that.
    if ranks := killed(failures):
        rank, failure = min(ranks.items())
        name = failure.signal_name()
        why = ": out of memory? the kernel's log (dmesg) says" if name == "SIGKILL" else ""
        print(
            f"error: rank {rank} (pid {failure.pid}){where} was killed by {name}{why}",
            file=sys.stderr,
        )
        return 128 - failure.exitcode
    rank, failure = first(failures)
    data, code = note(failure), failure.exitcode
    if data.get("exit_code") == RETRY_EXIT:  # a peer lost, a collective's timeout
        print(data["message"], file=sys.stderr)
        return RETRY_EXIT
    if code - 128 in STOP_SIGNALS:  # a stop signal sent to a worker: the ranks stopped together
        notes = [n for n in this_attempt(failures) if n.get("exit_code") == code]
        if not notes:  # not through plumbing/failures.run
            name = signal.Signals(code - 128).name
            print(f"rank {rank} (pid {failure.pid}){where} stopped on {name}", file=sys.stderr)
        elif not any(n.get("said") for n in notes) and any(n.get("here") for n in notes):
            print(next(n["message"] for n in notes if n.get("here")), file=sys.stderr)
        return code
    if data:
        print(data["message"], file=sys.stderr)
    print(
        f"error: rank {rank} (pid {failure.pid}){where} failed with exit code {code}"
        + (": its traceback is above" if data else ""),
        file=sys.stderr,
    )
    return code


def on_signal(number, frame):
    """As torchrun's own handler (the agent stops the workers with the same signal), also for
    SIGUSR1, which torch 2.9's torchrun leaves deadly; but a second signal (after STOP_GRACE:
    before, it is the same stop sent to several processes) ends the launch at once: torchrun would
    send it on and wait its whole shutdown timeout again. The workers die with this
    process (PR_SET_PDEATHSIG)."""
    name = signal.Signals(number).name
    if received and time.monotonic() - received[0][1] < STOP_GRACE:
        return  # the same stop, delivered twice (GNU timeout, scancel)
    if received:
        stuck = ", ".join(
            f"rank {rank} (pid {pid})" for pid, (rank, *_) in stopping.items() if alive(pid)
        )
        print(
            f"{name} again: ending now"
            + (f", without waiting for {stuck} to stop" if stuck else ""),
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + number)
    received.append((number, time.monotonic()))
    raise SignalException(
        f"Process {os.getpid()} got signal: {name}", sigval=signal.Signals(number)
    )


def take_the_signals():
    if threading.current_thread() is threading.main_thread():  # where Python runs handlers
        for number in STOP_SIGNALS:
            signal.signal(number, on_signal)


def start(context, start=PContext.start):
    """torchrun's start of the workers, which first sets its own handler for four of the stop
    signals (not SIGUSR1 on torch 2.9): ours replace it."""
    started[0] = time.time()
    start(context)
    take_the_signals()
    handlers = getattr(context, "subprocess_handlers", None) or {}
    workers.clear()
    workers.update({handler.proc.pid: handler.proc for handler in handlers.values()})


def close(handler, death_sig=None, close=SubprocessHandler.close):
    """torchrun passes a stop signal on to each worker's process group, then, to those that did not
    stop within its shutdown timeout, SIGKILL: each is named here first. A worker still starting
    (importing torch, before the script's StopSignals) would print a KeyboardInterrupt traceback
    for SIGINT: it gets SIGTERM, which ends it quietly, and main() says the one line."""
    pid = handler.proc.pid
    if death_sig == signal.SIGKILL and pid in stopping:
        rank, since, name, _ = stopping[pid]
        print(
            f"error: rank {rank} (pid {pid}) did not stop within {time.monotonic() - since:.0f} s "
            f"of {name}: stuck in a collective, or stopped? killing it; it wrote no checkpoint",
            file=sys.stderr,
            flush=True,
        )
    elif death_sig is not None and pid not in stopping:
        training = catches(pid, signal.SIGUSR1)  # StopSignals is set: the rank will say where
        stopping[pid] = (rank_of(pid), time.monotonic(), signal.Signals(death_sig).name, training)
        if death_sig == signal.SIGINT and not training:
            death_sig = signal.SIGTERM
    close(handler, death_sig)


def monitor(agent, worker_group, monitor=LocalElasticAgent._monitor_workers):
    """torchrun's check of its workers; a bad input (exit code 2) is not retried: it would fail
    the same way. A restart says why in one line (torchrun's own log lines are left out)."""
    result = monitor(agent, worker_group)
    if not result.is_failed():
        return result
    if any(f.exitcode == 2 for f in result.failures.values()):
        agent._remaining_restarts = 0
    elif agent._remaining_restarts:  # torchrun restarts them next: say why, once
        attempts = worker_group.spec.max_restarts + 1
        attempt = attempts - agent._remaining_restarts
        print(
            f"attempt {attempt} of {attempts} failed: {cause(result.failures)}; torchrun restarts "
            f"the workers (attempt {attempt + 1} of {attempts})",
            file=sys.stderr,
            flush=True,
        )
    return result


def next_rendezvous(handler, next_rendezvous=DynamicRendezvousHandler.next_rendezvous):
    """Each round (the first, and each restart's) gets a fresh store for the workers, which
    torchrun opens on a port the system picks (0) and holds: nothing can take it between choosing
    it and binding it, as when the workers' rank 0 binds a port chosen earlier
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; launches started together raced for one). torchrun's own
    shared store is made once and kept across restarts, where the dead workers' keys break the new
    ones' start (pytorch issue 135712), and the other nodes keep the address of a rank-0 node that
    has left."""
    handler._bootstrap_store_info = handler._shared_tcp_store_server = None
    return next_rendezvous(handler)


def stopped(number):
    """The exit code of a launch stopped by a signal: 0 if every worker had finished (it came after
    the last step, and a requeued job would find nothing to do), else 128 + its number, with one
    line if no worker was training yet."""
    name = signal.Signals(number).name
    codes = [process.poll() for process in workers.values()]
    if codes and all(code == 0 for code in codes):
        print(
            f"{name} came after the last step: the run had finished, and is complete",
            file=sys.stderr,
        )
        return 0
    if not any(training for *_, training in stopping.values()):  # nobody to say where it stopped
        print(f"stopped by {name} during start-up: nothing was trained or saved", file=sys.stderr)
    return 128 + number


def main():
    no_rendezvous = os.environ.pop(
        "LAUNCH_SH_NO_RENDEZVOUS", "error: not all nodes joined within the join timeout"
    )
    sys.argv[0] = "torchrun"
    for name, quiet in (("multiprocessing.api", quiet_workers), ("agent.server.api", quiet_agent)):
        logging.getLogger(f"torch.distributed.elastic.{name}").addFilter(quiet)
    PContext.start, SubprocessHandler.close = start, close
    LocalElasticAgent._monitor_workers = monitor
    DynamicRendezvousHandler.next_rendezvous = next_rendezvous
    take_the_signals()
    try:
        run(parse_args(sys.argv[1:]))
    except SignalException as stop:
        code = stopped(stop.sigval)
        # Not sys.exit: Python's exit puts the default handlers back, then unloads torch for
        # seconds, where a copy of the signal ended the launch by it (-15, not 143).
        atexit._run_exitfuncs()  # (private: no public way) what exit runs: logging, temp files
        sys.stdout.flush()
        os._exit(code)
    except ChildFailedError as failed:
        sys.exit(ending(failed.failures))
    except RendezvousTimeoutError:
        print(no_rendezvous, file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
