"""--resume-from STEP: resume from step-<N> or a path, not the newest (opt-in: imported only when
the flag is given, so a copy without this file refuses the flag in one line)."""

import os

from plumbing.checkpoint_dir import complete, history, unused_path
from plumbing.failures import UsageError, on_rank_0


def choose(checkpointer, found, log):
    """Collective: the chosen checkpoint (path, checkpoint.json), or ``found`` (the newest in
    --checkpoint-dir) when it descends from the chosen one: a requeue goes on, not back. The
    checkpoints newer than the chosen one move aside, never resumed from again, never deleted."""
    self, chosen = checkpointer, checkpointer.args.resume_from
    if found and found[1].get("branch") == chosen:  # a requeue or a restart
        log(f"--resume-from {chosen} was applied before: its branch goes on from {found[0]}")
        return found
    path = chosen if os.sep in chosen else os.path.join(self.directory or ".", chosen)

    def there():  # on rank 0
        if not os.path.isdir(path):
            raise UsageError(not_found(self, chosen, path))

    on_rank_0(there, f"finding --resume-from {chosen}")
    info, problem = self.intact(path)  # collective; a read error raises
    if problem:
        raise UsageError(f"--resume-from {chosen} is not an intact checkpoint ({problem})")
    on_rank_0(lambda: _set_aside_newer(self, chosen, info["step"], log), "moving newer ones aside")
    self.branch = chosen
    return path, info


def _set_aside_newer(self, chosen, step, log):  # on rank 0
    newer = [name for name in self.complete() if int(name[5:]) > step]
    for name in newer:
        aside = unused_path(os.path.join(self.directory, "abandoned-" + name))
        os.replace(os.path.join(self.directory, name), aside)
    if newer:
        moved = ", ".join(newer)
        log(f"--resume-from {chosen}: the newer {moved} moved aside to abandoned-step-<N>")


def not_found(checkpointer, chosen, path):
    """The line for a ``path`` that is not there: the checkpoints that are, and, if the folder
    records it, that --keep-checkpoints pruned it."""
    folder, name = os.path.split(os.path.normpath(path))
    found = complete(folder or ".")
    line = f"--resume-from {chosen}: no such checkpoint; {folder or '.'} holds "
    line += f"{', '.join(found)}: resume from one of those" if found else "none"
    if name in history(folder or ".").get("pruned", {}):
        keep = checkpointer.args.keep_checkpoints
        line += f" ({name} was pruned: --keep-checkpoints {keep} keeps the newest {keep}; "
        line += "raise it to keep more)"
    return line
