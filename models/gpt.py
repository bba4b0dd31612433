"""A small GPT (a decoder-only transformer, as nanoGPT's) built as a stack of blocks, like BabyCNN.

The model is a plain ``nn.Module`` whose forward runs ``self.blocks`` and nothing else:

    blocks = Sequential(Embed, Block, ..., Block, Head)

* ``Embed``: token and position embeddings (and dropout), ids (B, T) -> activations (B, T, n_embd);
* ``Block``: pre-LayerNorm causal self-attention (``F.scaled_dot_product_attention``, is_causal) and
  an MLP (4x wide, GELU), each added to the residual stream;
* ``Head``: the final LayerNorm and a linear map to the vocabulary: logits (B, T, vocab_size).

The embedding and the head sit inside ``blocks`` so that train_pippy.py, which cuts ``blocks`` into
contiguous stages and refuses a forward that does anything besides running them in order, can cut
the model anywhere: the first stage takes the ids, the last returns the logits. DDP replicates it
whole and FSDP shards it block by block, as they do BabyCNN.

It is nanoGPT's model: no biases (on its Linears and LayerNorms), the head tied to the token
embedding (one weight, the head's logits the embedding's rows), and query, key and value computed
by one Linear, ``qkv``. Its output rows are ordered by head (head 0's query, key and value, then
head 1's...), not nanoGPT's (all queries, all keys, all values): a tensor-parallel plan splits a
Linear's output rows into contiguous chunks, so each rank holds whole heads of all three. The
attention reshapes by ``head_dim`` (-1 heads) so the same code runs on a rank that holds only some
heads. The scripts keep the tied weight one (tests/test_gpt_training.py): a pipeline, whose first
and last stages each hold a copy, sums their gradients every step; FSDP shards it in the root, the
unit around both modules; TP splits both by vocabulary and ties the parts again.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

# --model's GPTs: nanoGPT's two sizes for Tiny Shakespeare (65 characters), less the context: the
# data's windows' (models/data.py's GPT_CONTEXT, 64 and 256). gpt, its CPU recipe's: 804,096
# parameters; gpt-gpu, its GPU recipe's (config/train_shakespeare_char.py): 10,745,088.
SIZES = {
    "gpt": {"n_layer": 4, "n_head": 4, "n_embd": 128, "dropout": 0.0},
    "gpt-gpu": {"n_layer": 6, "n_head": 6, "n_embd": 384, "dropout": 0.2},
}


class Embed(nn.Module):
    """Token plus position embeddings, then dropout: ids (B, T) -> (B, T, n_embd)."""

    def __init__(self, vocab_size, block_size, n_embd, dropout, device=None, dtype=None):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, n_embd, device=device, dtype=dtype)
        self.positions = nn.Embedding(block_size, n_embd, device=device, dtype=dtype)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids):
        if ids.shape[-1] > self.positions.num_embeddings:  # else an index error deep inside
            raise ValueError(
                f"{ids.shape[-1]} tokens, but the GPT's context (block_size) is "
                f"{self.positions.num_embeddings}"
            )
        positions = torch.arange(ids.shape[-1], device=ids.device)
        return self.dropout(self.tokens(ids) + self.positions(positions))


class CausalSelfAttention(nn.Module):
    """Multi-head attention of each position to itself and the positions before it."""

    def __init__(self, n_embd, n_head, dropout, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        # Rows ordered by head: train_tp.py's check lets a split of this fused layer through.
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False, **kw)
        self.qkv.rows_by_head = True
        self.proj = nn.Linear(n_embd, n_embd, bias=False, **kw)  # residual: a smaller init
        self.head_dim, self.dropout = n_embd // n_head, dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        batch, time = x.shape[:2]
        # (B, T, heads x 3 x head_dim) -> (B, heads, T, 3 x head_dim) -> q, k, v, each
        # (B, heads, T, head_dim); -1: a tensor-parallel rank's heads
        qkv = self.qkv(x).view(batch, time, -1, 3 * self.head_dim).transpose(1, 2)
        q, k, v = qkv.split(self.head_dim, dim=-1)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(batch, time, -1)))


class MLP(nn.Module):
    """n_embd -> 4 x n_embd -> GELU -> n_embd, then dropout."""

    def __init__(self, n_embd, dropout, device=None, dtype=None):
        super().__init__()
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.fc = nn.Linear(n_embd, 4 * n_embd, **kw)
        self.proj = nn.Linear(4 * n_embd, n_embd, **kw)  # residual
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, n_embd, n_head, dropout, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.attn_norm = nn.LayerNorm(n_embd, bias=False, **kw)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, **kw)
        self.mlp_norm = nn.LayerNorm(n_embd, bias=False, **kw)
        self.mlp = MLP(n_embd, dropout, **kw)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Head(nn.Module):
    """The final LayerNorm, then logits over the vocabulary (the GPT ties ``out.weight`` to the
    token embedding's)."""

    def __init__(self, n_embd, vocab_size, device=None, dtype=None):
        super().__init__()
        self.norm = nn.LayerNorm(n_embd, bias=False, device=device, dtype=dtype)
        self.out = nn.Linear(n_embd, vocab_size, bias=False, device=device, dtype=dtype)

    def forward(self, x):
        return self.out(self.norm(x))


class GPT(nn.Module):
    """Embed, n_layer Blocks, Head, in ``blocks``: ids (B, T <= block_size) -> logits (B, T, vocab).

    The defaults are nanoGPT's CPU recipe for Tiny Shakespeare's 65 characters: 4 layers, 4 heads,
    128 wide, a context of 64: 0.80 M parameters. Initialised as nanoGPT: weights normal(0,
    0.02), the residual projections' scaled by 1 / sqrt(2 n_layer) (each block adds two of them to
    the residual stream, which would otherwise grow with depth), LayerNorms' weights at 1."""

    def __init__(
        self,
        vocab_size=65,
        block_size=64,
        n_layer=4,
        n_head=4,
        n_embd=128,
        dropout=0.0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        sizes = (vocab_size, block_size, n_layer, n_head)
        if min(sizes) < 1 or n_embd % n_head or not 0 <= dropout < 1:
            raise ValueError(
                f"the GPT needs positive sizes, n_embd a multiple of n_head and 0 <= "
                f"dropout < 1, got {vocab_size=} {block_size=} {n_layer=} {n_head=} "
                f"{n_embd=} {dropout=}"
            )
        self.config = {
            "vocab_size": vocab_size,
            "block_size": block_size,
            "n_layer": n_layer,
            "n_head": n_head,
            "n_embd": n_embd,
            "dropout": dropout,
        }
        kw = {"device": device, "dtype": dtype}
        self.blocks = nn.Sequential(
            Embed(vocab_size, block_size, n_embd, dropout, **kw),
            *(Block(n_embd, n_head, dropout, **kw) for _ in range(n_layer)),
            Head(n_embd, vocab_size, **kw),
        )
        self.tie_weights()
        if not next(self.parameters()).is_meta:  # meta: the caller's, after to_empty
            self.reset_parameters()

    def forward(self, ids):
        return self.blocks(ids)

    def tie_weights(self):
        """The head's weight the token embedding's, one parameter, as nanoGPT's (and Hugging
        Face's ``tie_weights``): call it again after ``to_empty``, which makes each its own."""
        self.blocks[-1].out.weight = self.blocks[0].tokens.weight

    @torch.no_grad()
    def reset_parameters(self):
        """nanoGPT's initialisation, from a generator seeded with ``torch.initial_seed()``, in
        float32 on the CPU: the same weights for a seed whatever the device and dtype (a float64
        model starts from the float32 model's values), and whatever random numbers the construction
        drew. For whole tensors: a model sharded before this call would need each rank to draw only
        its part."""
        generator = torch.Generator().manual_seed(torch.initial_seed())
        residual_std = 0.02 / math.sqrt(2 * self.config["n_layer"])
        drawn = set()  # the tied weight: drawn once, by the embedding
        for name, module in self.named_modules():
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()
            elif isinstance(module, (nn.Linear, nn.Embedding)) and module.weight not in drawn:
                std = residual_std if name.endswith(".proj") else 0.02
                values = torch.empty(module.weight.shape).normal_(0, std, generator=generator)
                module.weight.copy_(values)
                drawn.add(module.weight)


@torch.no_grad()
def generate(model, ids, new_tokens, temperature=1.0, generator=None):
    """``ids`` (B, T) followed by ``new_tokens`` sampled one at a time, each from the last
    position's logits over the last block_size ids (divided by ``temperature``); ``model``: a
    whole GPT."""
    was_training = model.training
    model.eval()
    context = model.config["block_size"]
    for _ in range(new_tokens):
        logits = model(ids[:, -context:])[:, -1].float() / temperature
        probabilities = torch.softmax(logits, dim=-1)
        ids = torch.cat([ids, torch.multinomial(probabilities, 1, generator=generator)], dim=1)
    model.train(was_training)
    return ids


def sample(model, state_dict, vocabulary, characters=240, seed=0):
    """The line the scripts print after training a GPT on text: what a GPT of ``model``'s config
    with ``state_dict``'s weights (the whole model's, gathered) writes after a newline, sampled on
    the CPU in float32 from a seeded generator, with a line before it. ``vocabulary``: the text's
    characters, one an id, in order. None for no weights (the ranks a gather leaves without)."""
    if not state_dict:
        return None
    whole = GPT(**model.config)
    whole.load_state_dict({name: tensor.float().cpu() for name, tensor in state_dict.items()})
    start = torch.tensor([[vocabulary.index("\n")]])
    ids = generate(whole, start, characters, generator=torch.Generator().manual_seed(seed))
    text = "".join(vocabulary[i] for i in ids[0, 1:].tolist())
    return f"the trained GPT writes {characters} characters:\n{text}"
