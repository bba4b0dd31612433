"""torchrun as launch.sh runs it: `python3 plumbing/torchrun.py [torchrun's arguments]`, torchrun's own code with
all output passing through, except how a launch ends, said in one line instead of torchrun's 40- to 80-line
ChildFailedError traceback:

  a bad input     the workers stopped with exit code 2 and rank 0 printed one `error:` line; if torchrun stopped
                  it before it could (another rank failed first), that line comes from the failed rank's error
                  file (plumbing/hardening.run writes it) and is printed here, by rank 0's node. Exit code 2.
  a crash         the first failed rank's traceback, once, from its error file (the ranks that failed after it,
                  because a peer had gone, are left out), then a line naming the rank. Exit code 1.
  a killed rank   one line: which rank, which signal (SIGKILL: often the kernel's out-of-memory killer). Exit 1.
  a stop signal   SIGTERM, SIGINT, SIGHUP, SIGQUIT or SIGUSR1 (SLURM's warning; torch 2.9's torchrun dies of it):
                  passed on to the workers, which say where they stopped; exit code 128 + the signal's number.
                  A rank that does not stop within torchrun's shutdown timeout (30 s) is named in one line before
                  it is killed; a second signal ends the launch at once, naming the ranks that had not stopped.
  no rendezvous   not all nodes joined within the join timeout: the line launch.sh passes as argument 1. Exit 2.

A copied command line works as it is with the real torchrun; only these endings differ.
"""

import glob
import json
import logging
import math
import os
import signal
import socket
import sys
import time

import torch.distributed.elastic.multiprocessing.api as elastic_api
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
from torch.distributed.run import parse_args, run  # not main(): its @record would log the failure once more

stopping = {}  # pid: (rank, when) of each worker torchrun sent a signal to stop it (a stop, or a failed peer)
received = []  # the stop signals this launch received


def rank_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as file:
            return dict(v.split(b"=", 1) for v in file.read().split(b"\0") if b"=" in v).get(b"RANK", b"?").decode()
    except OSError:
        return "?"


class Endings(logging.Filter):
    """torchrun's log lines about a failure or a stop, which the one line at the end says better."""

    def filter(self, record):
        text = str(record.msg)
        if text.startswith(("Sending process", "Unable to shutdown process")) and record.args:
            pid, signal_name = record.args[0], getattr(record.args[1], "name", record.args[1])
            if text.startswith("Sending"):  # a stop: the workers it signals, to name a stuck one later
                stopping[pid] = (rank_of(pid), time.monotonic())
            else:  # waited its shutdown timeout in vain (30 s by default)
                rank, since = stopping.get(pid, ("?", time.monotonic()))
                print(f"error: rank {rank} (pid {pid}) did not stop within {time.monotonic() - since:.0f} s of "
                      f"{signal_name}: stuck in a collective, or stopped? killing it; it wrote no checkpoint",
                      file=sys.stderr, flush=True)
        return not text.startswith(("failed (exitcode", "Sending process", "Unable to shutdown", "Received"))


def note(failure):  # what plumbing/hardening.run wrote in the rank's error file: {} when nothing
    return failure.error_file_data if isinstance(failure.error_file_data.get("message"), str) else {}


def this_attempt(failures):
    """The notes of every rank of this node in this attempt: those torchrun stopped before it saw them fail too (when it
    sees one rank fail, the speaker may be printing the line that very moment; torchrun waits for it to exit)."""
    folders = {os.path.dirname(os.path.dirname(failure.error_file)) for failure in failures.values()
               if os.path.isfile(failure.error_file)}
    notes = []
    for path in (path for folder in folders for path in glob.glob(os.path.join(folder, "*", "error.json"))):
        try:
            with open(path) as file:
                notes.append(json.load(file))
        except (OSError, ValueError):  # not written by plumbing/hardening.run (its writes are atomic)
            pass
    return [n for n in notes if isinstance(n, dict) and isinstance(n.get("message"), str)]


def ending(failures):
    """The one line (and exit code) for torchrun's failures, {global rank: ProcessFailure}."""
    if any(failure.exitcode == 2 for failure in failures.values()):  # the ranks found the same bad input
        notes = [n for n in this_attempt(failures) if n.get("exit_code") == 2]
        if not notes:  # not through plumbing/hardening.run: whatever the worker printed is above
            print(f"error: rank {min(failures)} exited with code 2", file=sys.stderr)
        elif not any(n.get("said") for n in notes) and any(n.get("here") for n in notes):  # the rank to say it is
            print(next(n["message"] for n in notes if n.get("here")), file=sys.stderr)  # on this node, and did not
        return 2
    where = f" on {socket.gethostname()}"
    # Killed by a signal, not one torchrun sent itself on seeing another rank fail (it may list those too).
    killed = {rank: failure for rank, failure in failures.items()
              if failure.exitcode < 0 and failure.pid not in stopping}
    if killed:  # the others failed because it had gone: their errors say only that
        rank, failure = min(killed.items())
        why = ": out of memory? the kernel's log (dmesg) says" if failure.signal_name() == "SIGKILL" else ""
        print(f"error: rank {rank} (pid {failure.pid}){where} was killed by {failure.signal_name()}{why}",
              file=sys.stderr)
        return 1
    rank, failure = min(failures.items(), key=lambda item: note(item[1]).get("time", math.inf))
    if note(failure):
        print(note(failure)["message"], file=sys.stderr)
    print(f"error: rank {rank} (pid {failure.pid}){where} failed with exit code {failure.exitcode}"
          + (": its traceback is above" if note(failure) else ""), file=sys.stderr)
    return 1


def on_signal(number, frame):
    """torchrun's own handler (the agent stops the workers with the same signal), also for SIGUSR1, which torch 2.9's
    torchrun leaves deadly (PET_SIGNALS_TO_HANDLE is newer); but a second signal ends the launch at once: torchrun
    would send it on and wait its whole shutdown timeout again. The workers die with this process (PR_SET_PDEATHSIG)."""
    name = signal.Signals(number).name
    if received:
        stuck = ", ".join(f"rank {rank} (pid {pid})" for pid, (rank, _) in stopping.items() if alive(pid))
        print(f"{name} again: ending now" + (f", without waiting for {stuck} to stop" if stuck else ""),
              file=sys.stderr, flush=True)
        os._exit(128 + number)
    received.append(number)
    raise SignalException(f"Process {os.getpid()} got signal: {name}", sigval=signal.Signals(number))


def main():
    timeout_error = sys.argv.pop(1)
    sys.argv[0] = "torchrun"
    for name in ("multiprocessing.api", "agent.server.api"):
        logging.getLogger(f"torch.distributed.elastic.{name}").addFilter(Endings())
    elastic_api._terminate_process_handler = on_signal  # what torchrun installs when it starts the workers
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
        signal.signal(number, on_signal)
    try:
        run(parse_args(sys.argv[1:]))
    except SignalException as stop:
        sys.exit(128 + int(stop.sigval))
    except ChildFailedError as failed:
        sys.exit(ending(failed.failures))
    except RendezvousTimeoutError:
        print(timeout_error, file=sys.stderr)
        sys.exit(2)


def alive(pid):  # a worker not yet reaped is a zombie: gone
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


if __name__ == "__main__":
    main()
