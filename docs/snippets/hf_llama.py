"""A Hugging Face causal LM as a copy of a script takes it: mymodel.py for the README's recipe.

A small LlamaForCausalLM built from a config (random init, no download; from_pretrained works the
same) whose head is tied to its embedding, as many LMs' are, and token windows to predict. Its
parts go in ``blocks``, run in order, so that train_pippy.py can cut it into stages. ``tp_plan``
is its tensor-parallel plan: it replaces train_tp.py's own (the GPT's) in a copy of that script.
tests/test_hf_llama.py trains it under every script.
"""

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import LlamaConfig, LlamaForCausalLM

from plumbing import failures

CONFIG = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention: 2 query heads share each key and value
    max_position_embeddings=16,
    tie_word_embeddings=True,  # the head's weight is the embedding's
    attn_implementation="sdpa",  # causal without a mask
)


class Layer(nn.Module):
    """A decoder layer with the rotary position embedding its model computed once for all."""

    def __init__(self, layer, rotary):
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, x):  # (batch, positions, hidden) in and out
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        return self.layer(x, position_embeddings=self.rotary(x, positions))


class Head(nn.Module):
    """The final norm, then the logits over the vocabulary."""

    def __init__(self, norm, lm_head):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, x):
        return self.lm_head(self.norm(x))


class Net(nn.Module):
    """LlamaForCausalLM's parts as blocks: ids (batch, positions) -> logits (..., vocabulary)."""

    def __init__(self):
        super().__init__()
        llama = LlamaForCausalLM(CONFIG)  # ties lm_head.weight to embed_tokens.weight
        inner = llama.model
        layers = [Layer(layer, inner.rotary_emb) for layer in inner.layers]
        self.blocks = nn.Sequential(inner.embed_tokens, *layers, Head(inner.norm, llama.lm_head))

    def forward(self, ids):
        return self.blocks(ids)


def tp_plan(model, tp):
    """The Llama's TP plan, by module name (Net's): heads by columns, projections back by
    rows, the embedding and tied head by vocabulary, the logits kept split."""
    config = model.blocks[1].layer.self_attn.config  # the heads, read from the model
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % tp or kv_heads % tp:
        raise failures.UsageError(
            f"--tp {tp} must divide the Llama's {heads} query heads and {kv_heads} key/value heads"
        )
    last = len(model.blocks) - 1  # blocks.0 is the embedding, the last the head
    plan = {
        "blocks.0": RowwiseParallel(input_layouts=Replicate()),  # sums all-reduced
        f"blocks.{last}.lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for index in range(1, last):
        attention, mlp = f"blocks.{index}.layer.self_attn", f"blocks.{index}.layer.mlp"
        plan |= {
            f"{attention}.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")
        }
        plan[f"{attention}.o_proj"] = RowwiseParallel()
        plan |= {f"{mlp}.{name}": ColwiseParallel() for name in ("gate_proj", "up_proj")}
        plan[f"{mlp}.down_proj"] = RowwiseParallel()
    return plan


class Clusters(torch.utils.data.Dataset):  # the README's name; here, windows of a sequence
    """``count`` windows of 16 tokens, each following the one before by a fixed rule from a
    random start; the targets are the windows moved on by one."""

    def __init__(self, count, seed):
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, CONFIG.vocab_size, (count, 1), generator=generator)
        for _ in range(CONFIG.max_position_embeddings):
            tokens = torch.cat([tokens, (5 * tokens[:, -1:] + 3) % CONFIG.vocab_size], dim=1)
        self.tokens = tokens

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        return self.tokens[index, :-1], self.tokens[index, 1:]
