"""The course reads in order: a glossary, every term linked where a page first uses it, a short
first page, and the claims of the pages that are not about one strategy (the flight recorder; bf16
in the pipeline: test_pippy.py).

The first-use rule, as checked here. docs/glossary.md has one `### term` entry per term; TERMS below
gives each entry the words that count as a use of it. On each page (README.md and docs/*.md but the
glossary), the first use of each term must sit in the text of a link to its glossary entry or to the
page that teaches it (the page an entry's own links lead to, such as concepts.md for "rank"), or
inside the section that teaches it, on that page. What is not reading text is left out: code blocks,
HTML comments, images, headings, and the navigation lines (the breadcrumb at the top, the contents
list of in-page links, "Next: ..."). Inline code counts, so `DistributedSampler` and `no_sync()` are
uses. A use is matched without regard to case (the exceptions say (?-i:...)), across line breaks.
"""

import json
import os
import re

from conftest import ROOT, child_env, succeeded, torchrun
from test_docs import anchors, blocks, prose_lines

GLOSSARY = ROOT / "docs" / "glossary.md"
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p != GLOSSARY)]

# glossary anchor: what counts as a use of the term (a regex; a space matches any run of white
# space)
TERMS = {
    "activation-checkpointing": r"\bactivation[- ]checkpointing\b",
    "all-gather": r"\ball[-_ ]gather(s|ed|ing)?\b",
    "all-reduce": r"\ball[-_ ]reduc(e|es|ed|ing)\b",
    "autocast": r"\bautocast\b",
    "backend": r"(?<!\.)\bbackends?\b",
    "barrier": r"\bbarriers?\b",
    "bf16-and-fp16": r"\b(bf16|fp16|bfloat16|float16)\b",
    "broadcast": r"\bbroadcast(s|ing)?\b",
    "bubble": r"\bbubbles?\b",
    "bucket": r"\bbuckets?\b",
    "c10d": r"(?<!=)\bc10d\b",
    "collective": r"\bcollectives?\b",
    "data-parallelism": r"(?<!sharded\x20)(?<!distributed\x20)(?<!-)\bdata[- ]parallel(ism)?\b",
    "dcp": r"(?-i:\bDCP\b)|\btorch\.distributed\.checkpoint\b(?!\.)",
    "ddp": r"(?-i:\bDDP\b)|\bDistributedDataParallel\b",
    "device-mesh": r"\bdevice[- ]mesh(es)?\b|\binit_device_mesh\b|\bDeviceMesh\b",
    "distributedsampler": r"\bDistributedSampler\b",
    "dtensor": r"\bDTensors?\b",
    "elastic-agent": r"\belastic agents?\b|\btorchrun's agent\b",
    "flight-recorder": r"\bflight[- ]recorders?\b",
    "fsdp": r"(?-i:\bFSDP\d?\b)|\bfully_shard\b|\bFullyShardedDataParallel\b",
    "global-batch": r"\bglobal batch(es)?\b|\bglobal_batch_size\b",
    "gloo": r"\bgloo\b",
    "gradient-accumulation": r"\bgradient accumulation\b",
    "gradscaler": r"\bGradScaler\b",
    "hsdp": r"(?-i:\bHSDP\b)|\bhybrid shard(ing|ed)?\b",
    "local-rank": r"(?-i:\b[Ll]ocal[ _]ranks?\b)",
    "meta-device": r"\bmeta\b",
    "micro-step": r"\bmicro-steps?\b",
    "microbatch": r"\bmicro-?batch(es)?\b|\bmicro_batch\b",
    "mixed-precision": r"\bmixed[- ]precision\b",
    "nccl": r"\bNCCL\b",
    "node": r"(?<!-)\bnodes?\b",
    "no_sync": r"\bno_sync\b",
    "optimizer-state": r"\boptimi[sz]er state\b",
    "pipeline-parallelism": r"\bpipeline[- ]parallel(ism)?\b",
    "placement": r"\bplacements?\b|(?-i:\bPartial\b)",
    "point-to-point": r"\bpoint-to-point\b",
    "process-group": r"\bprocess[- ]groups?\b",
    "rank": r"(?<!local\x20)(?<!local_)(?<!-)(?-i:\b[Rr]anks?\b)",
    "reduce-scatter": r"\breduce[-_ ]scatter(s|ed|ing)?\b",
    "rendezvous": r"\brendezvous\b",
    "replica": r"\breplicas?\b",
    "schedule": r"\bschedule\.step\b|--schedule\b|\bpipeline schedules?\b|\bschedules?(?= "
    r"\((GPipe|1F1B))",
    "sequence-parallelism": r"\bsequence[- ]parallel(ism)?\b",
    "shard": r"\bshards?\b",
    "stage": r"\bstages?\b",
    "store": r"\bTCPStore\b|\bHashStore\b|\b(key-value|rendezvous|shared) store\b",
    "tensor-parallelism": r"\btensor[- ]parallel(ism)?\b|(?-i:\bTP\b)",
    "tf32": r"\bTF32\b|\bTensorFloat-32\b",
    "torchcompile": r"\btorch\.compile\b|--compile\b",
    "torchrun": r"\btorchrun\b",
    "world-size": r"(?-i:\b[Ww]orld[ _]size\b)",
}

LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def glossary_entries():
    """{anchor: (term, [link targets in the entry])} of docs/glossary.md's ### entries."""
    entries, current = {}, None
    for line in prose_lines(GLOSSARY):
        match = HEADING.match(line)
        if match and len(match.group(1)) == 3:
            term = match.group(2)
            slug = re.sub(r"[^\w\- ]", "", term.strip().lower()).replace(" ", "-")
            current = entries[slug] = (term, [])
        elif match:
            current = None
        elif current is not None:
            current[1].extend(target for _, _, target in LINK.findall(line))
    return entries


def resolve(page, target):
    """(file, fragment) a link of ``page`` leads to."""
    path, _, fragment = target.partition("#")
    return ((page.parent / path).resolve() if path else page), fragment


def teaching(entry):
    """The files an entry's links lead to, other than the glossary: the pages that teach the
    term."""
    return {
        file for file, _ in (resolve(GLOSSARY, t) for t in entry[1]) if file != GLOSSARY.resolve()
    }


def reading_text(page):
    """(visible text, [(start, end, target)] of the link texts in it, {heading anchor: (start, end)}
    of sections).

    The page's prose as a reader reads it, as one string as long as the file, so that an offset in
    it is one in the file: code blocks, comments, images, headings and navigation lines blanked;
    each link's markup but its text blanked; backticks blanked."""
    raw = page.read_text().splitlines()
    code = {n for first, _, block in blocks(page) for n in range(first - 1, first + len(block) + 1)}
    lines = [" " * len(line) if n in code else line for n, line in enumerate(raw, 1)]
    sections, open_sections, slugs = {}, [], set(anchors(page))
    kept = []
    offset = 0
    for line in lines:
        heading = HEADING.match(line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(2).strip().lower()).replace(" ", "-")
            level = len(heading.group(1))
            for name, lvl, start in [s for s in open_sections if s[1] >= level]:
                sections[name] = (start, offset)
                open_sections.remove((name, lvl, start))
            if slug in slugs and slug not in sections:
                open_sections.append((slug, level, offset))
            line = " " * len(line)
        elif (
            re.fullmatch(
                r"\s*(\[[^\]]*\]\([^)]*\)\s*(→\s*)?|\*\*[^*]+\*\*\s*(→\s*)?)+\s*", line
            )  # breadcrumb
            or re.fullmatch(r"\s*[-*] \[[^\]]*\]\(#[^)]*\)\s*", line)  # contents
            or line.startswith("Next:")
        ):
            line = " " * len(line)
        kept.append(line)
        offset += len(line) + 1
    text = "\n".join(kept)
    text = re.sub(r"<!--.*?-->", lambda m: " " * len(m.group()), text, flags=re.S)
    visible, links, position = [], [], 0
    length = 0
    for match in LINK.finditer(text):
        visible.append(text[position : match.start()])
        length += match.start() - position
        if match.group(1):  # an image: not reading text
            visible.append(" " * (match.end() - match.start()))
            length += match.end() - match.start()
        else:
            label = match.group(2)
            links.append((length + 1, length + 1 + len(label), match.group(3)))
            # the label where it stands in the file, the rest of the markup blanked
            visible.append(" " + label + " " * (match.end() - match.start() - 1 - len(label)))
            length += match.end() - match.start()
        position = match.end()
    visible.append(text[position:])
    for name, _, start in open_sections:
        sections[name] = (start, len(text))
    return "".join(visible).replace("`", " ").replace("\n", " "), links, sections


def compile_term(pattern):
    return re.compile(pattern.replace(" ", r"\s+"), re.I)


def first_use_problems(page, entries):
    text, links, sections = reading_text(page)
    problems = []
    for anchor, pattern in TERMS.items():
        match = compile_term(pattern).search(text)
        if not match:
            continue
        taught_by = teaching(entries[anchor])
        here = page.resolve() in taught_by
        accepted = False
        for start, end, target in links:
            if start <= match.start() and match.end() <= end:
                file, fragment = resolve(page, target)
                accepted = (file == GLOSSARY.resolve() and fragment == anchor) or file in taught_by
                break
        if not accepted and here:  # inside the section that teaches it, on its own page
            fragments = {
                resolve(GLOSSARY, t)[1]
                for t in entries[anchor][1]
                if resolve(GLOSSARY, t)[0] == page.resolve()
            }
            accepted = any(
                sections.get(f, (1, 0))[0] <= match.start() < sections.get(f, (1, 0))[1]
                for f in fragments
            )
        if not accepted:
            context = text[max(0, match.start() - 60) : match.end() + 40].strip()
            name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
            problems.append(
                f"{name}: {match.group()!r} (glossary #{anchor}) first used "
                f"without a link: ...{context}..."
            )
    return problems


def test_every_glossary_entry_links_to_the_section_that_teaches_it():
    entries = glossary_entries()
    assert set(entries) == set(TERMS), (
        f"entries without a pattern here: {sorted(set(entries) - set(TERMS))}; "
        f"patterns without an entry: {sorted(set(TERMS) - set(entries))}"
    )
    problems = []
    for anchor, entry in entries.items():
        if not teaching(entry):
            problems.append(f"#{anchor}: no link to a page that teaches it")
        for target in entry[1]:
            file, fragment = resolve(GLOSSARY, target)
            if not file.exists():
                problems.append(f"#{anchor}: {target}: no such file")
            elif fragment and fragment not in anchors(file):
                problems.append(f"#{anchor}: {target}: no such heading")
    assert not problems, "\n".join(problems)


def test_the_rule_finds_an_unlinked_term(tmp_path):
    """The negative control of the test below: a page that uses terms without links fails it, one
    that links them passes."""
    entries = glossary_entries()
    bare = tmp_path / "bare.md"
    bare.write_text("# A page\n\nEach rank joins the process group.\n")
    found = first_use_problems(bare, entries)
    assert len(found) == 2 and "'rank'" in found[0] + found[1], found
    docs = os.path.relpath(ROOT / "docs", tmp_path)  # links from the probe page to the real pages
    linked = tmp_path / "linked.md"
    linked.write_text(
        f"# A page\n\n[README]({docs}/../README.md) → **here**\n\n- [A page](#a-page)\n\n"
        f"Each [rank]({docs}/glossary.md#rank) joins the\n[process "
        f"group]({docs}/concepts.md#rank).\n"
        "```bash\nworld size in code does not count\n```\n"
    )
    assert first_use_problems(linked, entries) == []


def test_every_glossary_term_is_linked_at_its_first_use_on_each_page():
    entries = glossary_entries()
    problems = [problem for page in PAGES for problem in first_use_problems(page, entries)]
    assert not problems, f"{len(problems)} first uses without a link:\n" + "\n".join(problems)


def test_the_concepts_page_is_short():
    lines = len((ROOT / "docs" / "concepts.md").read_text().splitlines())
    assert lines <= 190, (
        f"docs/concepts.md has {lines} lines: it is the first page, keep it to about 180"
    )


def test_the_readme_is_at_most_200_lines():
    """The front page: it grew to 251 lines, its detail now in docs/reference.md (issue 56)."""
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 200, f"README.md has {lines} lines: move detail into docs/reference.md"


NOT_LESSONS = {"glossary.md", "reference.md", "measurements.md"}  # looked up, not read through


def prose_sentences(text):
    """The sentences of a page's prose, counted as ../shared/tools/prose_stats.py counts them: code
    blocks, tables, headings, HTML and images left out; inline code one word; a sentence ends at . !
    or ? and a space; fragments under 3 words are not sentences."""
    kept, fence = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        line = line.strip()
        if fence or not line or line.startswith(("|", "#", "<", "![", "[README]")):
            continue
        kept.append(re.sub(r"`[^`]*`", "X", re.sub(r"\]\([^)]*\)", "]", line)))
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(kept)) if len(s.split()) >= 3]


def test_the_lessons_are_an_evening_of_reading():
    """At most 22,000 words in all (code and tables included), no page over 3,500, the README and
    the lessons within two hours' reading, and sentences of at most 22 words on average: the course
    is read beside the code, not instead of it."""
    lessons = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in NOT_LESSONS]
    words = {p.name: len(p.read_text().split()) for p in lessons}
    assert sum(words.values()) <= 22_000, f"the lessons have {sum(words.values()):,} words: {words}"
    assert max(words.values()) <= 3_500, f"a lesson over 3,500 words: {words}"
    readme = len((ROOT / "README.md").read_text().split())
    minutes = (sum(words.values()) + readme) / 200  # two hours at 200 words a minute
    assert minutes <= 120, f"the README and the lessons take {minutes:.0f} minutes to read"
    for page in [ROOT / "README.md", *lessons]:
        sentences = prose_sentences(page.read_text())
        mean = sum(len(s.split()) for s in sentences) / len(sentences)
        assert mean <= 22, f"{page.name}: sentences of {mean:.1f} words on average"


def test_the_sentence_count_follows_the_rule():
    """The rule above, on a page made for it: a table, code and a heading are not sentences."""
    page = (
        "# Title here now\n\n| a b c | d |\n```\nx = 1. y = 2. z\n```\n"
        "One two three. Four `f(a. b)` six seven.\n"
    )
    assert [len(s.split()) for s in prose_sentences(page)] == [3, 4]


# ---- the flight recorder ----


def test_the_flight_recorder_shows_which_rank_stopped_where():
    """docs/checkpoints.md: in docs/snippets/flight_recorder.py rank 1 skips the fourth all-reduce;
    each rank's flight recorder shows how far it got, 4 on rank 0 and 3 on rank 1."""
    run = succeeded(
        torchrun("docs/snippets/flight_recorder.py", 2, env=child_env(TORCH_FR_BUFFER_SIZE=2000))
    )
    last = {
        int(rank): (int(count), json.loads(entry))
        for rank, count, entry in re.findall(
            r"^rank (\d): (\d+) collectives recorded, the last: (\{.*\})$", run.output, re.M
        )
    }
    assert set(last) == {0, 1}, run.output
    assert "Timed out" in run.output, run.output
    for rank, seq in ((0, 4), (1, 3)):
        count, entry = last[rank]
        assert (count, entry["collective_seq_id"], entry["profiling_name"]) == (
            seq,
            seq,
            "gloo:all_reduce",
        ), last
        assert entry["input_sizes"] == [[1000]] and entry["timeout_ms"] == 2000, last
