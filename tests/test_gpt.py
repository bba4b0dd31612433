"""The GPT's foundations, with no launch: Tiny Shakespeare as it ships (checked, split, served as
windows), the model (shapes, causality, its loss at init, that it learns, that blocks cut anywhere
are the whole model, that the pipeline's start-up check takes it), and evaluation over targets."""

import argparse
import gzip
import math
import re
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import ROOT
from torch.utils.data import DataLoader, TensorDataset

from models import GPT, data, sample, shakespeare
from models.gpt import SIZES
from plumbing import training

SHARED = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "README.md"  # where it came from
TINY = {"vocab_size": 65, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}  # fast configs


def checksums(readme):
    """(bytes, sha256) of input.txt from a README's table."""
    row = re.search(r"(?m)^\| input\.txt \| ([\d,]+) \| ([0-9a-f]{64}) \|$", readme.read_text())
    return int(row.group(1).replace(",", "")), row.group(2)


@pytest.fixture(scope="module")
def splits():
    return shakespeare.split(shakespeare.read())


def test_the_bundled_text_is_the_original_tiny_shakespeare_split_as_nanogpt_splits_it(splits):
    table = checksums(ROOT / "models" / "tinyshakespeare" / "README.md")
    assert table == (shakespeare.SIZE, shakespeare.SHA256)  # the README says what read() checks
    if SHARED.exists():  # the table the file came with
        assert checksums(SHARED) == table
    vocabulary, train_ids, val_ids = splits
    assert vocabulary == "\n !$&',-.3:;?" + "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
    assert (len(train_ids), len(val_ids)) == (1_003_854, 111_540)  # nanoGPT's prepare.py's figures
    assert train_ids.dtype == torch.int64 and int(train_ids.max()) == 64
    train, _ = shakespeare.datasets(splits, torch.device("cpu"))
    assert train.decode(train_ids[:14]) == "First Citizen:"


def test_a_damaged_copy_is_refused_in_one_line(tmp_path):
    original = gzip.decompress((ROOT / "models" / "tinyshakespeare" / "input.txt.gz").read_bytes())
    path = tmp_path / "input.txt.gz"
    edited = original.replace(b"First Citizen", b"First Citizan", 1)  # one letter
    for damage, error in [
        (gzip.compress(edited), r"is not the original Tiny Shakespeare: 1,115,394 bytes of SHA"),
        (gzip.compress(original[:-1]), r"is not the original Tiny Shakespeare: 1,115,393 bytes"),
        (gzip.compress(original)[:1000], r"is a damaged gzip archive"),
        (None, r"is missing"),
    ]:
        path.unlink(missing_ok=True)
        if damage is not None:
            path.write_bytes(damage)
        with pytest.raises(data.DataError, match=f"^{re.escape(str(path))} {error}") as caught:
            shakespeare.read(tmp_path)
        message = str(caught.value)
        assert "\n" not in message
        assert message.endswith("restore it (git checkout models/tinyshakespeare)")
    shutil.copy(ROOT / "models" / "tinyshakespeare" / "input.txt.gz", path)  # the control
    assert len(shakespeare.read(tmp_path)) == shakespeare.SIZE


def test_windows_tile_the_text_and_targets_are_the_next_characters(splits):
    train_ids = splits[1]
    train, val = shakespeare.datasets(splits, torch.device("cpu"), block_size=64)
    # Windows of 65 characters every 64: each character but the first is a target once an epoch.
    assert len(train) == (1_003_854 - 65) // 64 + 1 == 15_685
    assert len(val) == (111_540 - 65) // 64 + 1 == 1_742
    assert train.vocab_size == 65
    inputs, targets = train[torch.tensor([0, 1, len(train) - 1])]  # training.Batches gathers so
    assert inputs.shape == targets.shape == (3, 64) and inputs.is_contiguous()
    assert torch.equal(inputs[1], train_ids[64:128]) and torch.equal(targets[1], train_ids[65:129])
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # shifted by one
    assert all(map(torch.equal, train[1], (inputs[1], targets[1])))  # one by one too
    with pytest.raises(IndexError):
        train[len(train)]
    loader = DataLoader(train, batch_size=3, sampler=[0, 1, len(train) - 1])  # as with --workers
    loaded = next(iter(loader))
    assert all(map(torch.equal, loaded, (inputs, targets)))
    assert len(shakespeare.datasets(splits, torch.device("cpu"), 64, stride=1)[1]) == 111_540 - 64


def test_find_and_load_serve_the_text_to_the_scripts():
    found = data.find("shakespeare", None)
    assert found["broken"] is None and found["missing"] is None
    with pytest.raises(data.DataError, match=r"^--data-dir mine is not read with --dataset shake"):
        data.find("shakespeare", "mine")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # a collective
    try:
        name, train, val = data.load(found, torch.device("cpu"), block_size=32)
    finally:
        dist.destroy_process_group()
    assert name == "shakespeare" and train.block_size == val.block_size == 32
    batches = training.Batches(val, 8, torch.device("cpu"), torch.float32)
    assert batches.loader is None  # gathered on the device, no DataLoader
    inputs, targets = next(batches(list(range(8))))
    assert inputs.shape == targets.shape == (8, 32) and inputs.dtype == torch.int64


def test_model_sets_its_recipes_defaults_and_a_flag_given_wins():
    parse = training.parser("", data.add_arguments).parse_args
    cnn, gpt = parse([]), parse(["--model", "gpt"])
    assert vars(cnn) == vars(parse(["--model", "cnn"]))  # BabyCNN's quick start: the shared ones

    def plan(args):
        return args.batch_size, args.max_steps, args.warmup_steps, args.lr, args.epochs

    assert plan(cnn) == (64, 0, None, None, 2) and plan(gpt) == (16, 900, None, None, 2)
    for flags in (["--batch-size", "8", "--model", "gpt"], ["--model", "gpt", "--batch-size", "8"]):
        assert parse(flags).batch_size == 8  # before --model or after it
    gpu = parse(["--model", "gpt-gpu", "--max-steps", "1000"])
    recipe = (gpu.batch_size, gpu.lr, gpu.weight_decay, gpu.max_grad_norm, gpu.warmup_steps)
    assert recipe == (64, 1e-3, 0.1, 1.0, None) and (gpu.max_steps, gpu.epochs) == (1000, 100)
    # The warmup is the shared rule's: 100 steps for these runs (nanoGPT's), a fifth of a short one
    short = parse(["--model", "gpt", "--max-steps", "20"])
    runs = ((gpt, 32, 900), (gpu, 64, 5000), (short, 32, 20))
    assert [training.peak_and_warmup(*run)[1] for run in runs] == [100, 100, 4]


def test_model_gpt_gpu_is_nanogpts_gpu_size_on_windows_of_its_context():
    import models

    found = data.find(None, None, model="gpt-gpu")
    assert found["block_size"] == 256 and data.find(None, None, model="gpt")["block_size"] == 64
    train, _ = shakespeare.datasets(found["splits"], torch.device("cpu"), found["block_size"])
    torch.manual_seed(0)
    model = models.build(argparse.Namespace(model="gpt-gpu"), train)
    assert sum(p.numel() for p in model.parameters()) == 10_745_088  # nanoGPT's model's count
    assert model.config == {
        "vocab_size": 65,
        "block_size": 256,
        "n_layer": 6,
        "n_head": 6,
        "n_embd": 384,
        "dropout": 0.2,
    }
    assert set(SIZES) == set(data.GPT_CONTEXT)  # --model's GPTs: a size and a context each


def test_the_sample_is_written_by_a_gpt_of_the_models_config_with_the_weights_given(splits):
    vocabulary = splits[0]
    torch.manual_seed(0)
    model = GPT(**TINY)  # not GPT()'s defaults: sample() builds the model's config
    line = sample(model, model.state_dict(), vocabulary, characters=40)
    head, text = line.split("\n", 1)
    assert head == "the trained GPT writes 40 characters:" and len(text) == 40, line
    assert set(text) <= set(vocabulary)
    # Any dtype, on the CPU in float32: a float64 copy of the weights writes the same.
    doubled = {name: tensor.double() for name, tensor in model.state_dict().items()}
    assert sample(model, doubled, vocabulary, characters=40) == line
    # Negative control: other weights write other text (the weights given, not the model's own).
    torch.manual_seed(1)
    other = GPT(**TINY).state_dict()
    assert sample(model, other, vocabulary, characters=40) != line
    assert sample(model, {}, vocabulary) is None  # a rank the gather leaves without weights


def test_the_gpt_maps_ids_to_logits_causally_from_the_seed():
    torch.manual_seed(0)
    model = GPT()
    assert sum(p.numel() for p in model.parameters()) == 804_096  # nanoGPT's CPU recipe
    assert [type(b).__name__ for b in model.blocks] == ["Embed", *["Block"] * 4, "Head"]
    ids = torch.randint(0, 65, (3, 64), generator=torch.Generator().manual_seed(1))
    logits = model(ids)
    assert logits.shape == (3, 64, 65)
    changed = ids.clone()
    changed[:, 40] = (changed[:, 40] + 1) % 65  # a later token: the logits before it do not move
    after = model(changed)
    assert torch.equal(after[:, :40], logits[:, :40])
    assert not torch.allclose(after[:, 40:], logits[:, 40:])
    with pytest.raises(ValueError, match="65 tokens, but the GPT's context"):
        model(torch.zeros(1, 65, dtype=torch.int64))
    # From the seed alone, whatever the dtype: a float64 model starts from the float32 one's values.
    torch.manual_seed(0)
    again = GPT(dtype=torch.float64)
    assert all(torch.equal(a.double(), b) for a, b in zip(model.parameters(), again.parameters()))


def test_it_is_nanogpts_model_tied_without_biases_its_query_key_value_ordered_by_head():
    """The head's weight is the token embedding's (one parameter, drawn once), nothing has a bias,
    and the fused qkv's rows are head 0's query, key and value, then head 1's: the attention is
    the one computed from three separate matrices taken out of it head by head."""
    torch.manual_seed(0)
    model = GPT(**TINY)
    embed, head = model.blocks[0], model.blocks[-1]
    assert head.out.weight is embed.tokens.weight and len(list(model.parameters())) == 2 + 6 * 2 + 1
    assert not [name for name, _ in model.named_parameters() if name.endswith("bias")]
    assert 0.015 < embed.tokens.weight.std().item() < 0.025  # nanoGPT's normal(0, 0.02)
    attention = model.blocks[1].attn
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    heads, size = 2, 16
    rows = attention.qkv.weight.view(heads, 3, size, 32)  # (head, q/k/v, head_dim, n_embd)

    def split(weight):  # (B, T, heads x head_dim) -> (B, heads, T, head_dim)
        return (x @ weight.reshape(heads * size, 32).T).view(2, 16, heads, size).transpose(1, 2)

    q, k, v = (split(rows[:, i]) for i in range(3))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 16, 32)
    expected = attention.proj(y)
    assert torch.allclose(attention(x), expected, atol=1e-6)
    # Negative control: the rows read as nanoGPT orders them (all queries, then keys, values).
    q, k, v = (split(part) for part in attention.qkv.weight.chunk(3))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 16, 32)
    assert (attention.proj(y) - expected).abs().max() > 1e-3


def test_its_loss_at_init_is_that_of_a_uniform_guess_and_it_overfits_a_batch(splits):
    torch.manual_seed(0)
    train, _ = shakespeare.datasets(splits, torch.device("cpu"), block_size=64)
    inputs, targets = train[torch.arange(12)]
    model = GPT()
    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    assert abs(loss.item() - math.log(65)) < 0.05  # small logits (std 0.02 weights): near uniform
    torch.manual_seed(0)
    small = GPT(**TINY)
    inputs, targets = train[torch.arange(8)]
    inputs, targets = inputs[:, :16], targets[:, :16]
    optimizer = torch.optim.AdamW(small.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(100):
        loss = F.cross_entropy(small(inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 1.0  # from 4.17 in 100 steps: it learns (128 targets, 30 k parameters)


def test_blocks_cut_anywhere_are_the_whole_model_and_the_pipeline_takes_it():
    from train_pippy import balanced_stages, block_flops

    torch.manual_seed(0)
    model = GPT(**TINY, dropout=0.1).eval()  # eval: dropout off
    ids = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(1))
    whole = model(ids)
    for cut in range(1, len(model.blocks)):
        x = ids
        for stage in (model.blocks[:cut], model.blocks[cut:]):  # two stages, as train_pippy.py's
            x = stage(x)
        assert torch.equal(x, whole), cut
    # The start-up check: the blocks run in order are the forward; matrix multiplies' FLOPs by block
    costs = block_flops(model, ids[:1])
    linears = 2 * 16 * (4 * 32 * 32 + 2 * 32 * 128)  # qkv, proj; fc, proj: 2 FLOPs a MAC
    # torch 2.14's FlopCounterMode counts no attention on the CPU (the fused kernel): blocks equal.
    assert costs[0] == 0 and costs[1] == costs[2] >= linears and costs[3] == 2 * 16 * 32 * 65
    assert balanced_stages(costs, 2) == [[0, 1], [2, 3]]


def test_evaluation_counts_targets_not_samples():
    """training.evaluate over a fake forward with known logits: a language model's (B, T, C) logits
    and (B, T) labels give the loss per target and the accuracy of next-token prediction, and (B, C)
    logits (BabyCNN's) per sample, as before; over 2 ranks, with padding, the sums add up."""
    samples, tokens, classes = 5, 4, 3
    labels = torch.arange(samples * tokens).remainder(classes).view(samples, tokens)  # 0, 1, 2, 0
    inputs = torch.arange(samples, dtype=torch.float32).view(samples, 1)  # the sample's index

    def forward(x):  # class 0 scores log 2, the others 0: a loss of log 4 - log 2 where 0 is right
        logits = torch.zeros(*x.shape[:1], *([tokens] if dense else []), classes)
        logits[..., 0] = math.log(2)
        return logits

    for dense in (True, False):
        y = labels if dense else labels[:, 0]
        batches = training.Batches(TensorDataset(inputs, y), 2, torch.device("cpu"), torch.float32)
        # 3 + 2 samples
        totals = sum(training.evaluate(forward, batches, rank, 2) for rank in range(2))
        right = int((y == 0).sum())
        loss = right * math.log(2) + (y.numel() - right) * math.log(4)  # -log(2/4), -log(1/4)
        assert totals.tolist() == pytest.approx([loss, right, y.numel()])
        loss_per_target, accuracy = (totals[:2] / totals[2]).tolist()  # as the scripts divide
        assert loss_per_target == pytest.approx(loss / y.numel()) and accuracy == right / y.numel()


def test_the_start_lines_flops_count_attention_on_a_cpu_too():
    """FLOPs of a sample, forward and backward, as the start line prints them: each weight's
    multiply-adds (6 x tokens x the Linear weights) and attention's two products per layer (12 x
    layers x tokens^2 x width). The CPU's fused attention kernel shows the counter no FLOPs: the
    GPT's line said 305.2 MFLOPs, 7.6 % short of the 330.4 counted here by hand."""
    from models.gpt import GPT
    from plumbing import watch

    torch.manual_seed(0)
    model = GPT()  # nanoGPT's CPU size: 4 layers, 128 wide, 64 tokens, 65 characters
    tokens, width, layers = 64, 128, 4
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert linear == layers * 12 * width**2 + width * 65
    weights, attention = 6 * tokens * linear, 12 * layers * tokens**2 * width
    flops = watch.flops_per_sample(model, torch.randint(0, 65, (1, tokens)))
    assert flops == weights + attention == 330_350_592, (flops, weights)
