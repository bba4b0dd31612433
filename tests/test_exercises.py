"""The exercises of the lesson pages: every command runs, every stated answer holds.

The format, strict so that it can be read here. A page's exercises are the `### ` subsections of its
`## Exercises` section. Each one has, in this order:

- one ```bash block of commands, one per line (a trailing backslash continues a line): either
  `NPROC_PER_NODE=N bash run_*.sh FLAGS` or `python SCRIPT FLAGS` (a train_*.py, or
  benchmarks/read_trace.py reading an earlier command's --log-dir), each with `--metrics NAME.json`.
  NAME.json names the run: the same name on any page must be the same command, and is run once here,
  after the commands above it in its block. An exercise that breaks a script on purpose makes a copy
  first, `sed 'EDIT' train_*.py > BROKEN.py` (the edit must change it), and launches the copy with
  `NPROC_PER_NODE=N bash launch.sh BROKEN.py FLAGS`;
- the question, in prose;
- `<details><summary>Answer</summary>`, the answer in prose, then one or more checks, each an HTML
  comment of its own (hidden on GitHub), then `</details>`:

    <!-- check: RUN prints "TEXT" -->              RUN's output has TEXT (the launcher's own
                                                   `launch.sh:` line aside)
    <!-- check: RUN exits N -->                    RUN ended with exit code N
    <!-- check: RUN KEY == VALUE -->               in RUN's metrics file, KEY equals VALUE (JSON)
    <!-- check: RUN KEY rounds to VALUE -->         the number at KEY, or each number there,
                                                   rounds to VALUE's (JSON) as written: a loss
                                                   the answer quotes to 4 decimals
    <!-- check: RUN KEY ~ RUN2 KEY2 within T -->    the numbers at KEY and KEY2 differ by at most T
    <!-- check: RUN KEY !~ RUN2 KEY2 beyond T -->  ... by more than T somewhere (the negative
                                                   control)
    <!-- check: RUN KEY between LO and HI -->      every number at KEY lies in [LO, HI]: a measured
                                                   time, which moves with the machine

  RUN is a run's NAME.json. KEY is a dotted path into the metrics JSON; `*` takes every element of a
  list (`ranks.*.state_bytes`, `loss_curve.*.1`: the loss column). The answer's prose must state
  each exact value (a number as printed or with thousands separators, a printed TEXT in full), so a
  reader sees what the test checks; an exercise with a `~` check must have a `!~` check whose
  tolerance is at least 100 times larger, so the tolerance is shown to sit far below a real
  difference.
  A `between` check's answer states LO and HI, as the page writes them.

The strategies' pages (DDP, FSDP, pipeline) have at least three exercises, every other lesson
at least one.
A run's --metrics, --log-dir, --checkpoint-dir and --out go to this test's temporary directory.

The commands also parse with the scripts' own parsers (tests/test_docs.py). The runs are marked slow
(pytest.ini): variations of what the other files launch, they check the pages' answers; CI runs
them.
"""

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, Run, launcher_env, python, run_sh

LEAST = {
    "concepts.md": 1,
    "collectives.md": 1,
    "ddp.md": 3,
    "batch.md": 1,
    "fsdp.md": 3,
    "pipeline.md": 3,
    "parallelism.md": 1,
    "transformer.md": 2,
    "checkpoints.md": 1,
    "cluster.md": 1,
}  # at least
PAGES = [ROOT / "docs" / name for name in LEAST]
# tests/test_exercises_later.py runs these pages' exercises: a file of its own, which pytest-xdist
# (--dist loadfile) gives the other worker. The halves share no run (each would launch it).
LATER = [ROOT / "docs" / name for name in ("pipeline.md", "parallelism.md", "checkpoints.md")]
LATER += [ROOT / "docs" / "cluster.md"]
CHECK = re.compile(r"<!-- check: (.*?) -->")
FORMS = [
    ("rounds", re.compile(r"(?P<run>\S+\.json) (?P<key>\S+) rounds to (?P<value>.+)$")),
    ("prints", re.compile(r'(?P<run>\S+\.json) prints "(?P<text>[^"]+)"$')),
    ("exits", re.compile(r"(?P<run>\S+\.json) exits (?P<code>\d+)$")),
    ("equals", re.compile(r"(?P<run>\S+\.json) (?P<key>\S+) == (?P<value>.+)$")),
    (
        "near",
        re.compile(
            r"(?P<run>\S+\.json) (?P<key>\S+) ~ (?P<other>\S+\.json) (?P<other_key>\S+) within "
            r"(?P<tol>\S+)$"
        ),
    ),
    (
        "far",
        re.compile(
            r"(?P<run>\S+\.json) (?P<key>\S+) !~ (?P<other>\S+\.json) (?P<other_key>\S+) beyond "
            r"(?P<tol>\S+)$"
        ),
    ),
    (
        "between",
        re.compile(
            r"(?P<run>\S+\.json) (?P<key>\S+) between (?P<low>\S+) "
            r"and (?P<high>\S+)$"
        ),
    ),
]


def parse_check(text):
    for kind, form in FORMS:
        match = form.match(text.strip())
        if match:
            return kind, match.groupdict()
    raise AssertionError(f"a check this test cannot read: <!-- check: {text} -->")


def exercises(page):
    """[(title, [command words], question, visible answer, [(kind, fields)])] of the page's
    Exercises section."""
    text = page.read_text()
    match = re.search(r"^## Exercises\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"{page.name} has no ## Exercises section"
    found = []
    for part in re.split(r"^### ", match.group(1), flags=re.M)[1:]:
        title = part.splitlines()[0]
        shape = re.fullmatch(
            r".*?\n```bash\n(?P<commands>.*?)\n```\n(?P<question>.*?)"
            r"<details><summary>Answer</summary>\n(?P<answer>.*?)</details>\s*",
            part,
            re.S,
        )
        assert shape, (
            f"{page.name}, exercise {title!r}: not a bash block, a question, then a folded answer"
        )
        lines = shape["commands"].replace("\\\n", " ").splitlines()
        commands = [shlex.split(line) for line in lines if line.strip()]
        checks = [parse_check(check) for check in CHECK.findall(shape["answer"])]
        visible = CHECK.sub("", shape["answer"])
        found.append((title, commands, shape["question"].strip(), visible, checks))
    return found


def run_name(words):
    assert "--metrics" in words, (
        f"{' '.join(words)}: an exercise's command names its run with --metrics NAME.json"
    )
    return words[words.index("--metrics") + 1]


def all_commands():
    """{NAME.json: the command's words}, over every page; the same name is the same command
    everywhere."""
    return {name: words for name, (words, _) in commands_and_before().items()}


def is_edit(words):
    """`sed 'EDIT' train_*.py > BROKEN.py`: the copy an exercise breaks."""
    return (
        words[0] == "sed"
        and len(words) == 5
        and words[3] == ">"
        and re.fullmatch(r"train_\w+\.py", words[2])
    )


def edits():
    """{BROKEN.py: the sed words that make it}, over every page; one name, one edit."""
    made = {}
    for page in PAGES:
        for title, commands, *_ in exercises(page):
            for words in filter(is_edit, commands):
                assert made.setdefault(words[4], words) == words, (
                    f"{words[4]} is made by two different edits"
                )
    return made


def commands_and_before():
    """{NAME.json: (its words, the names above it in its blocks)}: a trace's reader runs after its
    run."""
    named = {}
    for page in PAGES:
        for title, commands, *_ in exercises(page):
            commands = [words for words in commands if not is_edit(words)]
            names = [run_name(words) for words in commands]
            for index, (name, words) in enumerate(zip(names, commands)):
                known, before = named.setdefault(name, (words, set()))
                assert known == words, f"{name} names two different commands"
                before.update(names[:index])
    return named


def numbers(value):
    """Every number in a JSON value, in order."""
    if isinstance(value, list):
        return [n for item in value for n in numbers(item)]
    assert isinstance(value, (int, float)) and not isinstance(value, bool), value
    return [value]


def quoted(value):
    """The numbers of a check's VALUE as written: ["4.1775", "2.8127"] of [4.1775, 2.8127]."""
    return re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", value)


def states(number, visible):
    return str(number) in visible or (isinstance(number, int) and f"{number:,}" in visible)


def test_every_page_has_its_exercises_in_the_format():
    runs = all_commands()
    for page in PAGES:
        found = exercises(page)
        assert len(found) >= LEAST[page.name], f"{page.name}: {len(found)} exercises"
        for title, commands, question, visible, checks in found:
            where = f"{page.name}, exercise {title!r}"
            assert commands and question and checks, where
            made = [words[4] for words in commands if is_edit(words)]
            for words in commands:
                assert (
                    (words[0].startswith("NPROC_PER_NODE=") and words[1:2] == ["bash"])
                    or words[0] == "python"
                    or is_edit(words)
                ), f"{where}: {' '.join(words)}"
                if words[2:3] == ["launch.sh"]:
                    assert words[3] in made, (
                        f"{where}: {words[3]} is not made by a sed line above it"
                    )
            for kind, fields in checks:
                assert fields["run"] in runs and fields.get("other", fields["run"]) in runs, (
                    f"{where}: {fields}"
                )
                if kind == "prints":
                    assert fields["text"] in visible, (
                        f"{where}: the answer does not state {fields['text']!r}"
                    )
                if kind == "equals":
                    missing = [
                        n for n in numbers(json.loads(fields["value"])) if not states(n, visible)
                    ]
                    assert not missing, f"{where}: the answer does not state {missing}"
                if kind == "rounds":
                    missing = [n for n in quoted(fields["value"]) if n not in visible]
                    assert not missing, f"{where}: the answer does not state {missing}"
                if kind == "between":
                    assert float(fields["low"]) < float(fields["high"]), f"{where}: {fields}"
                    missing = [fields[k] for k in ("low", "high") if fields[k] not in visible]
                    assert not missing, f"{where}: the answer does not state {missing}"
            near = [float(fields["tol"]) for kind, fields in checks if kind == "near"]
            far = [float(fields["tol"]) for kind, fields in checks if kind == "far"]
            assert not near or (far and min(far) >= 100 * max(near)), (
                f"{where}: a tolerance needs a negative control"
            )


class Runs:
    """Each named run, launched the first time a check needs it and kept for the others (this file's
    tests)."""

    def __init__(self, directory):
        self.directory, self.commands, self.done = directory, commands_and_before(), {}
        self.edits = edits()

    def broken_copy(self, name):
        """directory/BROKEN.py, made by its page's sed line from the script here; it imports this
        repository's plumbing and models (child_env's PYTHONPATH)."""
        sed = self.edits[name]
        made = subprocess.run(sed[:3], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        assert made != (ROOT / sed[2]).read_text(), (
            f"{' '.join(sed)} changes nothing: the script changed"
        )
        (self.directory / name).write_text(made)
        return self.directory / name

    def __getitem__(self, name):
        if name not in self.done:
            words, before = self.commands[name]
            for earlier in sorted(before):
                self[earlier]
            words = list(words)
            args = words[words.index("bash") + 2 :] if words[0] != "python" else words[2:]
            for flag in ("--metrics", "--log-dir", "--checkpoint-dir", "--out"):
                if flag in args:
                    args[args.index(flag) + 1] = str(self.directory / args[args.index(flag) + 1])
            if words[0] == "python":
                run = python(words[1], *args)
            elif words[2] == "launch.sh":
                env = launcher_env(NPROC_PER_NODE=words[0].split("=", 1)[1])
                run = Run(
                    ["bash", ROOT / "launch.sh", self.broken_copy(words[3]), *args[1:]], env=env
                )
            else:
                script = (
                    Path(words[words.index("bash") + 1])
                    .name.replace("run_", "train_")
                    .replace(".sh", ".py")
                )
                run = run_sh(script, int(words[0].split("=", 1)[1]), *args)
            run.wait()
            path = self.directory / name
            metrics = json.loads(path.read_text()) if path.exists() else None
            output = "\n".join(
                line for line in run.output.splitlines() if not line.startswith("launch.sh:")
            )
            self.done[name] = (run.returncode, output, metrics)
        return self.done[name]

    def value(self, name, key):
        returncode, output, metrics = self[name]
        assert returncode == 0 and metrics is not None, (
            f"{name}: exit code {returncode}\n{output[-3000:]}"
        )
        values = [metrics]
        for part in key.split("."):
            if part == "*":
                values = [item for value in values for item in value]
            else:
                values = [
                    value[int(part)] if isinstance(value, list) else value[part] for value in values
                ]
        return values if "*" in key.split(".") else values[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("exercises"))


def all_exercises(pages):
    return [
        pytest.param(page, index, id=f"{page.stem}-{index + 1}")
        for page in pages
        for index in range(len(exercises(page)))
    ]


def runs_of(pages):
    """The names of the runs the checks of ``pages`` read, with the runs before them."""
    before = commands_and_before()
    found = set()
    for page in pages:
        for *_, checks in exercises(page):
            found |= {
                fields[key] for _, fields in checks for key in ("run", "other") if key in fields
            }
    while more := {earlier for name in found for earlier in before[name][1]} - found:
        found |= more
    return found


def test_the_two_files_of_exercises_launch_no_run_twice():
    first = [page for page in PAGES if page not in LATER]
    assert first and runs_of(first).isdisjoint(runs_of(LATER)), runs_of(first) & runs_of(LATER)


@pytest.mark.slow
@pytest.mark.pages
@pytest.mark.parametrize("page, index", all_exercises(p for p in PAGES if p not in LATER))
def test_the_exercise_answers_are_what_the_runs_give(runs, page, index):
    check_answers(runs, page, index)


def check_answers(runs, page, index):
    title, commands, question, visible, checks = exercises(page)[index]
    for kind, fields in checks:
        where = f"{page.name}, exercise {title!r}: {kind} {fields}"
        if kind in ("prints", "exits"):
            returncode, output, _ = runs[fields["run"]]
            if kind == "prints":
                assert fields["text"] in output, f"{where}\n{output[-3000:]}"
            else:
                assert returncode == int(fields["code"]), (
                    f"{where}: exit code {returncode}\n{output[-3000:]}"
                )
        elif kind == "equals":
            assert runs.value(fields["run"], fields["key"]) == json.loads(fields["value"]), where
        elif kind == "rounds":
            found, written = (
                numbers(runs.value(fields["run"], fields["key"])),
                quoted(fields["value"]),
            )
            decimals = [len(n.partition(".")[2]) for n in written]
            got = [f"{n:.{d}f}" for n, d in zip(found, decimals)]
            assert len(found) == len(written) and got == written, f"{where}: the run gives {found}"
        elif kind == "between":
            found = numbers(runs.value(fields["run"], fields["key"]))
            low, high = float(fields["low"]), float(fields["high"])
            assert found and all(low <= n <= high for n in found), f"{where}: {found}"
        else:
            mine = numbers(runs.value(fields["run"], fields["key"]))
            other = numbers(runs.value(fields["other"], fields["other_key"]))
            assert len(mine) == len(other) > 0, where
            apart = max(abs(a - b) for a, b in zip(mine, other))
            if kind == "near":
                assert apart <= float(fields["tol"]), f"{where}: {apart:.3g} apart"
            else:
                assert apart > float(fields["tol"]), f"{where}: only {apart:.3g} apart"
