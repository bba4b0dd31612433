"""What a person watching a run sees: in a terminal, rank 0's progress bar; in a pipe, a plain line
per logging step."""

import fcntl
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest
import torch
from conftest import ROOT, launcher_env, mnist_args

from plumbing import failures, log_dir, profile_steps, training, watch

RUN = [
    "--epochs",
    "5",
    "--max-steps",
    "120",
    "--log-every",
    "10",
    "--batch-size",
    "16",
]  # the stop saves a checkpoint


class Terminal:
    """``bash run_ddp.sh`` with a pseudo-terminal for its stdin, stdout and stderr, 100 columns
    wide, as a person's shell starts it: its own process group, which Ctrl-C (SIGINT) reaches whole.
    """

    def __init__(self, args, env):
        self.master, replica = pty.openpty()
        fcntl.ioctl(replica, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
        self.process = subprocess.Popen(
            ["bash", ROOT / "run_ddp.sh", *args],
            stdin=replica,
            stdout=replica,
            stderr=replica,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        os.close(replica)
        self.raw = b""
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        while True:
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # EIO: every process holding the terminal has ended
                return
            if not chunk:
                return
            self.raw += chunk

    def wait(self, timeout=120):
        self.process.wait(timeout)
        self.reader.join(10)
        os.close(self.master)
        return self.process.returncode

    def screen(self):
        """The lines as a terminal leaves them: of each, what follows its last carriage return (tqdm
        redraws a line by going back to its start), less the escape sequences that clear or move."""
        text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", self.raw.decode(errors="replace")).replace(
            "\r\n", "\n"
        )
        return [
            line.rsplit("\r", 1)[-1].rstrip()
            for line in text.split("\n")
            if line.rsplit("\r", 1)[-1].strip()
        ]

    def bars(self):
        """Every state of the bar drawn: (steps done, total)."""
        return [
            tuple(map(int, m))
            for m in re.findall(r"\| *(\d+)/(\d+) \[", self.raw.decode(errors="replace"))
        ]


def test_a_terminal_shows_one_bar_a_stop_line_and_a_resume_that_starts_at_its_checkpoint(
    mnist_dir, tmp_path
):
    """In a terminal rank 0 draws a bar (tqdm) instead of step lines: steps done of the total,
    epoch, the all-rank loss, samples/s, the time left. Ctrl-C stops at a checkpoint with its one
    line, the last; the same command resumes, and its bar starts at that checkpoint's step. (In a
    pipe, a line per logging step and no carriage return: tests/test_ddp.py's short run.)"""
    env = launcher_env(NPROC_PER_NODE=1)
    args = [*mnist_args(mnist_dir), *RUN, "--checkpoint-dir", tmp_path / "ck"]
    first = Terminal(args, env)
    deadline = time.monotonic() + 120
    while not any(done >= 30 for done, _ in first.bars()) and first.process.poll() is None:
        assert time.monotonic() < deadline, first.raw[-2000:]
        time.sleep(0.05)
    os.killpg(
        first.process.pid, signal.SIGINT
    )  # what Ctrl-C does: the whole foreground process group
    assert first.wait() == 130, first.raw[-2000:]
    screen = first.screen()
    stops = [line for line in screen if line.startswith("stopped by SIGINT")]
    assert len(stops) == 1 and re.fullmatch(
        r"stopped by SIGINT at step (\d+) of 120: checkpoint step-\1 is in "
        r".*ck; the same command resumes there",
        stops[0],
    ), screen
    assert screen[-1] == stops[0], screen  # the last line: the bar (closed) stays above it
    stopped_at = int(re.search(r"at step (\d+)", stops[0]).group(1))
    assert not [line for line in screen if line.startswith("step ")], (
        screen
    )  # no plain step lines in a terminal
    bar = next(line for line in reversed(screen) if "step/s" in line or "s/step" in line)
    assert re.match(
        rf"epoch \d: +\d+%\|.*\| {stopped_at}/120 \[\d\d:\d\d<\d\d:\d\d, .*loss \(all ranks\) "
        rf"\d\.\d{{4}}, "
        r"[\d,]+ samples/s\]$",
        bar,
    ), bar

    second = Terminal(args, env)
    assert second.wait() == 0, second.raw[-2000:]
    assert second.bars()[0] == (stopped_at, 120) and second.bars()[-1] == (120, 120), second.bars()
    assert f"resumed from {tmp_path / 'ck'}/step-{stopped_at} " in "\n".join(second.screen())
    assert not [line for line in second.screen() if line.startswith("step ")]


def test_without_tensorboard_the_log_dir_says_so_once_and_writes_the_csv(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(
        sys.modules, "torch.utils.tensorboard", None
    )  # as where it is not installed: import fails
    rows = log_dir.MetricsLog(str(tmp_path), 0, watch.log)
    rows.write(step=10, epoch=1, train_loss=0.5, lr=0.1, grad_norm=None, samples_per_second=100.0)
    assert capsys.readouterr().out == (
        f"--log-dir: writing {tmp_path}/metrics.csv; no TensorBoard events (pip install "
        "tensorboard for them)\n"
    )
    assert (tmp_path / "metrics.csv").read_text() == (
        "step,epoch,train_loss,lr,grad_norm,samples_per_second,test_loss,"
        "test_accuracy\n10,1,0.5,0.1,,100.0,,\n"
    )


@pytest.mark.parametrize(
    "flags, error",
    [
        (
            ["--profile-steps", "3:2"],
            "argument --profile-steps: give two steps A:B, 1 <= A <= B, not '3:2'",
        ),
        (
            ["--profile-steps", "2:3"],
            "--profile-steps 2:3 needs --log-dir, for the traces, and steps from 1 to this run's "
            "100",
        ),
        (
            ["--profile-steps", "2:300", "--log-dir", "logs"],
            "--profile-steps 2:300 needs --log-dir, for the traces, and "
            "steps from 1 to this run's 100",
        ),
    ],
)
def test_profile_steps_that_cannot_be_profiled_are_refused_in_one_line(flags, error):
    # UsageErrors: one line and exit code 2 from every launch (tests/test_bad_input.py shows the
    # path)
    with pytest.raises(failures.UsageError, match=re.escape(error)):
        args = training.parser("").parse_args(flags)
        profile_steps.Profiler(args, torch.device("cpu"), 0, 100, watch.log)
