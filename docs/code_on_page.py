"""Write the code the pages quote from the files themselves, so a page never shows stale code.

    python docs/code_on_page.py  # rewrite every generated block of README.md and docs/*.md
    # change nothing; exit 1 (and name them) if any block is stale
    python docs/code_on_page.py --check

A generated block is a fenced code block between two comments, which say what goes in it:

    <!-- generated: diff -u train_ddp.py train_fsdp.py -->  the unified diff, as `diff -u` prints it
    <!-- generated: file docs/snippets/join.py -->          a whole file
    <!-- generated: lines train_pippy.py "START" "END" -->   from the line containing START up to
                                                            the line containing END (not included),
                                                            dedented
    ```...```
    <!-- end generated -->

Paths are relative to the repository's root. Only the fenced block between the comments is
rewritten.
"""

import argparse
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^(<!-- generated: (.+?) -->\n)(.*?)^(<!-- end generated -->)$", re.S | re.M)
LANGUAGES = {".py": "python", ".sh": "bash", ".md": "markdown"}


def render(directive):
    """The fenced block a directive stands for."""
    kind, *args = shlex.split(directive)
    if kind == "diff" and len(args) == 3 and args[0] == "-u":
        old, new = args[1:]
        # --label: the file names without diff's timestamps, which would change with every checkout
        done = subprocess.run(
            ["diff", "-u", "--label", old, "--label", new, old, new],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if done.returncode not in (0, 1):  # 1: the files differ, which is the point
            raise SystemExit(f"code_on_page.py: {directive}: {done.stderr.strip()}")
        language, text = "diff", done.stdout
    elif kind == "file" and len(args) == 1:
        language, text = LANGUAGES.get(Path(args[0]).suffix, ""), (ROOT / args[0]).read_text()
    elif kind == "lines" and len(args) == 3:
        path, start, end = args
        lines = (ROOT / path).read_text().splitlines(keepends=True)
        first = [i for i, line in enumerate(lines) if start in line]
        if len(first) != 1:
            raise SystemExit(
                f"code_on_page.py: {directive}: {start!r} is on {len(first)} lines of {path}, not 1"
            )
        last = next((i for i in range(first[0] + 1, len(lines)) if end in lines[i]), None)
        if last is None:
            raise SystemExit(f"code_on_page.py: {directive}: no {end!r} after {start!r} in {path}")
        language, text = (
            LANGUAGES.get(Path(path).suffix, ""),
            textwrap.dedent("".join(lines[first[0] : last])),
        )
    else:
        raise SystemExit(f"code_on_page.py: cannot read the directive {directive!r}")
    fence = "```"
    while fence in text:
        fence += "`"
    return f"{fence}{language}\n{text.rstrip()}\n{fence}\n"


def generated(page_text):
    """The page with every generated block rewritten from its files."""
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2)) + m.group(4), page_text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if a block is stale"
    )
    args = parser.parse_args()
    stale = []
    for page in PAGES:
        text = page.read_text()
        new = generated(text)
        if new != text:
            stale.append(page.relative_to(ROOT))
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        print(
            f"stale generated code in {', '.join(map(str, stale))}: run python "
            "docs/code_on_page.py",
            file=sys.stderr,
        )
        return 1
    print(
        "every generated block is current"
        if args.check
        else f"rewrote: {', '.join(map(str, stale)) or 'nothing'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
