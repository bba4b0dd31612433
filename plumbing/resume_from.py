"""--resume-from STEP: resume from step-<N> or a path, not the newest (opt-in: imported only when
the flag is given, so a copy without this file refuses the flag in one line)."""

import os

from plumbing.checkpoint_dir import complete, unused_path, verify
from plumbing.failures import UsageError


def choose(checkpointer, found, log):
    """On rank 0: the chosen checkpoint (path, checkpoint.json), or ``found`` (the newest in
    --checkpoint-dir) when it descends from the chosen one: a requeue goes on, not back. The
    checkpoints newer than the chosen one move aside, never resumed from again, never deleted."""
    self, chosen = checkpointer, checkpointer.args.resume_from
    if found and self.branch == chosen:  # a requeue or a restart
        log(f"--resume-from {chosen} was applied before: its branch goes on from {found[0]}")
        return found
    path = chosen if os.sep in chosen else os.path.join(self.directory or ".", chosen)
    if not os.path.isdir(path):
        raise UsageError(not_found(self, chosen, path))
    info, problem = verify(path, self.layout)
    if problem:
        raise UsageError(f"--resume-from {chosen} is not an intact checkpoint ({problem})")
    newer = [name for name in self.complete() if int(name[5:]) > info["step"]]
    for name in newer:
        aside = unused_path(os.path.join(self.directory, "abandoned-" + name))
        os.replace(os.path.join(self.directory, name), aside)
    if newer:
        moved = ", ".join(newer)
        log(f"--resume-from {chosen}: the newer {moved} moved aside to abandoned-step-<N>")
    self.branch = chosen
    return path, info


def not_found(checkpointer, chosen, path):
    """The line for a ``path`` that is not there: the checkpoints that are, and why one is gone."""
    folder, name = os.path.split(os.path.normpath(path))
    found = complete(folder or ".")
    line = f"--resume-from {chosen}: no such checkpoint; {folder or '.'} holds "
    line += f"{', '.join(found)}: resume from one of those" if found else "none"
    keep, step = checkpointer.args.keep_checkpoints, name.removeprefix("step-")
    if found and step.isdigit() and int(step) < int(found[0][5:]) and len(found) >= keep:
        line += f" (--keep-checkpoints {keep} keeps the newest {keep}: {name} was deleted when "
        line += "newer ones were saved; raise it to keep more)"  # as each save does
    return line
