"""The activations the pages quote (docs/parallelism.md, "Activations" and the Llama-3-8B case),
held to a fresh run of docs/activation_memory.py: the bytes one block's forward keeps for
backward, counted with saved-tensor hooks on a CPU, and the formula the page writes from the GPT's
shapes. Marked slow and pages: about a minute (the Hugging Face import, six Llama layers, a
torchrun of 2 gloo processes)."""

import json
import re
import subprocess
import sys

import pytest
from conftest import ROOT, child_env

from docs import activation_memory

PAGE = ROOT / "docs" / "parallelism.md"


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("activations") / "activation_memory.json"
    command = [sys.executable, str(ROOT / "docs" / "activation_memory.py"), "--out", out]
    run = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(out.read_text())


def text():
    return " ".join(PAGE.read_text().split())


@pytest.mark.slow
@pytest.mark.pages
def test_a_gpt_block_keeps_what_its_shapes_say(measured):
    heads = 4
    for row in measured["gpt"]:
        tokens, width = row["batch"] * row["positions"], row["width"]
        assert row["bytes"] == 4 * tokens * (16 * width + heads + 4), row
        # the negative control: one more stream-sized tensor a block is another figure
        assert abs(row["bytes"] - 4 * tokens * (17 * width + heads + 4)) >= 4 * tokens * width
    first = measured["gpt"][0]
    assert (first["batch"], first["positions"], first["width"]) == (16, 64, 128)
    assert f"a block keeps {first['bytes']:,} bytes: 4 × B·T × (16·C + h + 4)" in text()
    # TP + SP on 2 ranks: the gathered norm outputs whole (2·C), the rest split, (h + 4) too
    t = len(measured["gpt_tp_sp_bytes"])
    split = 4 * 16 * 64 * (2 * 128 + 14 * 128 // t + (heads + 4) // t)
    assert measured["gpt_tp_sp_bytes"] == [split] * t and t == 2
    assert split != first["bytes"] // t  # the negative control: not a plain 1/t of the block
    assert f"whole: 2·C + 14·C/t. On {t} ranks each keeps {split:,} bytes" in text()
    checkpointed = measured["gpt_checkpointed_bytes"]
    assert checkpointed == 4 * 16 * 64 * 128 < first["bytes"] / 10
    assert f"input, 4 × B·T·C = {checkpointed:,} bytes here" in text()


@pytest.mark.slow
@pytest.mark.pages
def test_the_llama_case_is_the_benchmarks(measured):
    llama, case = measured["llama"], measured["llama_8b"]
    a, b, c, e, d = (llama[k] for k in "abced")
    law = f"{a:g}·C + {b:g}·H + {c:g}·C_kv + {e:g}·h + {d:g} bytes a token"
    assert law in text(), law
    # the law, fitted on five shapes, holds at a sixth: 12 heads of 32, 4 key/value heads
    sixth = activation_memory.llama_block(64, 384, 1344, 12, 4)
    assert sixth == a * 384 + b * 1344 + c * 128 + e * 12 + d
    # the negative control: another shape keeps other bytes
    assert activation_memory.llama_block(64, 384, 1344, 12, 6) != sixth
    assert f"{case['params']:,} parameters, a state of {16 * case['params'] / 1e9:.1f} GB" in text()
    assert f"At 4k context a layer keeps {case['layer'] / 1e6:.0f} MB a sequence" in text()
    rows = {}
    for line in PAGE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] in case["layouts"]:
            rows[cells[0]] = cells[1:]
    assert set(rows) == set(case["layouts"])
    for name, figures in case["layouts"].items():
        state, sequence, fit = rows[name]
        assert state == f"{figures['state'] / 1e9:.1f} GB", name
        assert sequence.startswith(f"{figures['sequence'] / 1e9:.1f} GB"), name
        found = re.findall(r"\d+", fit)
        assert (found[:1] or ["0"]) == [str(figures["fit"])], (name, fit)
    assert case["layouts"]["DDP"]["fit"] == 0 < case["layouts"]["FSDP 8"]["fit"]
    # the decision chart's last column
    fsdp, checkpointed = case["layouts"]["FSDP 8"], case["layouts"]["FSDP 8 + checkpointing"]
    for quote in (
        f"| the state, {case['layouts']['DDP']['state'] / 1e9:.1f} GB, does not |",
        f"| {fsdp['state'] / 1e9:.1f} GB a GPU, {fsdp['fit']} sequences; "
        f"{checkpointed['fit']} checkpointed |",
        f"| {case['layouts']['TP 8 + SP']['sequence'] / 1e9:.1f} GB a sequence, a ",
    ):
        assert quote in text(), quote
