"""The docs stay true to the code: commands use flags the scripts accept, links lead somewhere.

Every command in a ```bash block of README.md or docs/*.md that runs one of the project's scripts
(`python train_*.py`, `torchrun ... train_*.py`, `bash run_*.sh`, `sbatch slurm/train.sbatch ddp`,
`python benchmarks/*.py`, `python docs/*.py`) is
parsed by that script's own argparse parser, so a renamed or removed flag, or a value outside a
flag's choices, fails here instead of in a reader's terminal. The parsers are taken from the
scripts themselves, in this process (torch is already imported by conftest.py): each script runs
until it calls parse_args, which is replaced by a function that hands back the parser and stops
the script. That costs well under a second for all of them, where a `--help` subprocess per
script would import torch again each time (several seconds each on a 2-core machine).

The blocks docs/code_on_page.py writes into the pages (the code they quote: excerpts of the scripts,
the snippets) must be what it writes today: its --check finds them current.

Every relative link and image in those pages must point to a file that exists, and a link with a
#fragment to a heading of that page. docs/images/*.png are drawn by docs/figures.py and are
checked like any other file.
"""

import argparse
import contextlib
import io
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs"))
import code_on_page  # noqa: E402

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")  # NNODES=2 before a command
SEPARATORS = {"&&", "||", ";", "|", "&"}
REDIRECTIONS = {">", ">>", "<", ">&", "<&", "&>", "2>", "1>"}


def blocks(page):
    """(first line number, language, lines) of every fenced code block of a Markdown page."""
    found, current = [], None
    for number, line in enumerate(page.read_text().splitlines(), 1):
        match = FENCE.match(line)
        if current is None and match:
            current = (number + 1, match.group(2).lower(), [], match.group(1))
        elif (
            current is not None
            and line.strip().startswith(current[3])
            and not line.strip().strip(current[3][0])
        ):
            found.append(current[:3])
            current = None
        elif current is not None:
            current[2].append(line)
    assert current is None, (
        f"{page.name}: a code block opened on line {current[0] - 1} is never closed"
    )
    return found


def commands(page):
    """(line number, words) of every simple command in the page's bash blocks."""
    for first, language, lines in blocks(page):
        if language not in ("bash", "sh", "shell", "console"):
            continue
        logical, start = "", None
        for offset, line in enumerate(lines):
            start = first + offset if start is None else start
            if line.rstrip().endswith("\\"):  # a continued line: the command goes on below
                logical += line.rstrip()[:-1] + " "
                continue
            logical += line
            lexer = shlex.shlex(logical, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            words = []
            for word in [*lexer, ";"]:
                if word in SEPARATORS:
                    if words:
                        yield start, words
                    words = []
                else:
                    words.append(word)
            logical, start = "", None


def runner_scripts():
    """{run_*.sh: the training script it runs}, read from the wrappers themselves."""
    found = {}
    for wrapper in ROOT.glob("run_*.sh"):
        match = re.search(r"launch\.sh\"?\s+(\S+\.py)", wrapper.read_text())
        assert match, f"{wrapper.name} does not say which script launch.sh runs"
        found[wrapper.name] = match.group(1)
    return found


def script_call(words, wrappers):
    """(script path relative to the root, its arguments) when the command runs a project script."""
    while words and ASSIGNMENT.match(words[0]):  # launcher variables: NNODES=2 NODE_RANK=0 ...
        words = words[1:]
    kept = []  # without redirections (`> log.txt`) and their targets
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in REDIRECTIONS:
            skip = True
        else:
            kept.append(word)
    words = kept
    if not words:
        return None
    program, rest = Path(words[0]).name, words[1:]
    if (
        program == "sbatch"
    ):  # sbatch's own options (--nodes=4), then the batch script, run like `bash script`
        while rest and rest[0].startswith("-"):
            rest = rest[1:]
        program = "bash"
    if (
        program in ("bash", "sh") and rest and Path(rest[0]).name == "train.sbatch"
    ):  # STRATEGY, then its flags
        return (f"train_{rest[1]}.py", rest[2:]) if len(rest) > 1 else None
    if program in ("bash", "sh"):
        if rest and Path(rest[0]).name in wrappers:
            return wrappers[Path(rest[0]).name], rest[1:]
        if rest and Path(rest[0]).name == "launch.sh" and len(rest) > 1:
            return rest[1], rest[2:]
        return None
    if re.fullmatch(r"python[\d.]*", program):
        if rest[:2] == ["-m", "torch.distributed.run"]:
            program, rest = "torchrun", rest[2:]
        else:
            while (
                rest and rest[0].startswith("-") and rest[0] != "-m"
            ):  # interpreter options (-u, -X ...)
                rest = rest[1:]
            if not rest or rest[0] == "-m":  # python -m pytest, python -m pip: not a project script
                return None
            return rest[0], rest[1:]
    if program == "torchrun":  # torchrun's own options come before the script; the script's after
        for index, word in enumerate(rest):
            if word.endswith(".py"):
                return word, rest[index + 1 :]
    return None


def is_project_script(path):
    return re.fullmatch(r"train_\w+\.py|(benchmarks|docs)/\w+\.py", path) is not None


class _Parsed(Exception):
    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def parser_of(script):
    """The argparse parser ``script`` builds, taken at its parse_args call; the script stops
    there."""

    def capture(self, args=None, namespace=None):
        raise _Parsed(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", capture)
        patch.setattr(sys, "argv", [str(ROOT / script)])
        patch.syspath_prepend(
            str((ROOT / script).parent)
        )  # as `python script` would: benchmarks/ import premade
        try:
            runpy.run_path(str(ROOT / script), run_name="__main__")
        except _Parsed as parsed:
            return parsed.parser
    raise AssertionError(f"{script} finished without parsing any arguments")


def project_commands():
    wrappers = runner_scripts()
    # An exercise's broken copy (`sed 'EDIT' train_ddp.py > broken.py`) takes its script's flags.
    copies = {
        words[4]: words[2]
        for page in PAGES
        for _, words in commands(page)
        if words[0] == "sed" and len(words) == 5 and words[3] == ">"
    }
    for page in PAGES:
        for line, words in commands(page):
            call = script_call(words, wrappers)
            if call and call[0] in copies:
                call = (copies[call[0]], call[1])
            if call and (is_project_script(call[0]) or not (ROOT / call[0]).exists()):
                yield page, line, words, call


@pytest.fixture(scope="module")
def parsers():
    scripts = sorted({call[0] for *_, call in project_commands() if (ROOT / call[0]).exists()})
    return {script: parser_of(script) for script in scripts}


def test_the_docs_run_project_scripts():
    """The check below has something to check: the README's and the docs' commands are found."""
    found = {call[0] for *_, call in project_commands()}
    assert {"train_ddp.py", "train_fsdp.py", "benchmarks/compare.py"} <= found, found


def test_commands_use_flags_the_scripts_accept(parsers):
    problems = []
    for page, line, words, (script, args) in project_commands():
        where = f"{page.relative_to(ROOT)}:{line}: {' '.join(words)}"
        if not (ROOT / script).exists():
            problems.append(f"{where}\n    {script} does not exist")
            continue
        parser = parsers[script]
        accepted = parser._option_string_actions  # every option string: --flag, -h, --help
        unknown = [
            word.split("=", 1)[0]
            for word in args
            if word.startswith("-")
            and word != "-"
            and not re.fullmatch(r"-\d[\d.e-]*", word)
            and word.split("=", 1)[0] not in accepted
        ]  # exact names: argparse would take a prefix
        if unknown:
            problems.append(f"{where}\n    {script} has no flag {', '.join(unknown)}")
            continue
        if any("$" in word for word in args):
            # a placeholder ($NODE_RANK) is a value argparse cannot judge; the flags were checked
            continue
        # The values too: choices, types, a flag missing its value. The scripts' parser prints its
        # own error line (and exits 2); --help prints help (and exits 0).
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                parser.parse_args(args)
            except SystemExit as exit:
                if exit.code not in (0, None):
                    problems.append(f"{where}\n    {script} refuses it: {err.getvalue().strip()}")
    assert not problems, "\n".join(problems)


# ---- links ----

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def prose_lines(page):
    """The page's lines, with those of code blocks (fences included) left empty."""
    code = {
        number
        for first, _, lines in blocks(page)
        for number in range(first - 1, first + len(lines) + 1)
    }
    return [
        "" if number in code else line
        for number, line in enumerate(page.read_text().splitlines(), 1)
    ]


def prose(page):
    """The page without its code blocks and inline code, where links are not links."""
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", "\n".join(prose_lines(page)), flags=re.S)


def anchors(page):
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, -1, -2 for
    repeats."""
    seen, found = {}, set()
    for line in prose_lines(page):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


@pytest.mark.parametrize(
    "page",
    [*PAGES, ROOT / "benchmarks" / "README.md"],
    ids=lambda page: str(page.relative_to(ROOT)),
)
def test_links_and_images_point_to_files_that_exist(page):
    problems = []
    for target in LINK.findall(prose(page)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto: ...: not checked here
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(
                f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}"
            )
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            problems.append(f"{target}: no heading #{fragment} in {file.relative_to(ROOT)}")
    assert not problems, f"{page.relative_to(ROOT)}:\n    " + "\n    ".join(problems)


DIFF_COUNT = re.compile(
    r"`(diff train_\w+\.py train_\w+\.py \| grep -c '\^\[<>\]')` counts (\d+) changed lines"
)


def test_the_diff_sizes_the_docs_quote_are_the_scripts_own():
    """ "`diff train_ddp.py train_fsdp.py | grep -c '^[<>]'` counts N changed lines": N is what it
    counts now."""
    quoted = [
        (page.name, *found)
        for page in PAGES
        for found in DIFF_COUNT.findall(" ".join(prose_lines(page)))
    ]
    assert len(quoted) >= 1, quoted
    for page, command, count in quoted:
        counted = subprocess.run(
            command, shell=True, cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        assert counted == count, f"{page}: {command} counts {counted}, the page says {count}"


def test_the_generated_code_on_the_pages_is_current():
    done = subprocess.run(
        [sys.executable, ROOT / "docs" / "code_on_page.py", "--check"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr + "\nrun: python docs/code_on_page.py"
    pages = {page.name: page.read_text() for page in code_on_page.PAGES}
    for page, directive in [
        ("fsdp.md", 'lines train_fsdp.py "# Unsharded local gradients; the last"'),
        ("pipeline.md", 'lines train_pippy.py "# ---- wrap"'),
        ("batch.md", 'lines docs/snippets/dataloader.py "sampler = DistributedSampler("'),
    ]:
        assert f"<!-- generated: {directive}" in pages[page], f"{page} lost its block {directive!r}"
    # The check sees drift: one line of the quoted code changed is put back by the generator.
    text = pages["fsdp.md"]
    drifted = text.replace(
        "set_requires_gradient_sync(last_micro_step)", "set_requires_gradient_sync(True)", 1
    )
    assert drifted != text and code_on_page.generated(drifted) == text


def test_every_file_in_benchmarks_has_its_row_and_a_test_runs_it():
    """benchmarks/README.md's table: a row for each file there and nothing else, and each file run
    by a test, directly or through the files its row names (each of which names the file); a page
    names it in its exercises, which tests/test_exercises.py runs."""
    rows = {}
    for line in (ROOT / "benchmarks" / "README.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 3:
            rows[cells[0].strip("`")] = re.findall(r"`([\w/.]+)`", cells[2])
    files = subprocess.run(
        ["git", "ls-files", "benchmarks"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    present = set()
    for file in files:
        first, *rest = Path(file).relative_to("benchmarks").parts
        present.add(first + "/" if rest else first)  # a folder: "results/"
    present.discard("README.md")
    assert set(rows) == present, sorted(set(rows) ^ present)
    for name, runners in rows.items():
        for runner in runners:  # each names the file: its path, or the module it imports
            text = (ROOT / (runner if "/" in runner else f"benchmarks/{runner}")).read_text()
            if runner.endswith(".md"):
                text = text.partition("\n## Exercises")[2]
            assert Path(name).stem in text, f"{runner} does not run {name}"
    for name in present - {"results/"}:
        seen, todo = set(), [name]
        while todo:
            for runner in rows[todo.pop()]:
                if runner not in seen:
                    seen.add(runner)
                    todo += [runner] if runner in rows else []
        assert any(r.startswith("tests/") or r.endswith(".md") for r in seen), name
