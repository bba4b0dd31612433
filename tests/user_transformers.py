"""A user's own transformers, as the README's copy recipe takes them (tests/test_template.py): token
sequences to classify, and the model NET names (the environment) as the scripts' ``Net``."""

import os

import torch
from torch import nn

VOCAB, LENGTH, WIDTH = 16, 8, 16


class Clusters(torch.utils.data.Dataset):  # the README's name; here, is most of a sequence small?
    def __init__(self, count, seed):
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (count, LENGTH), generator=generator)
        self.labels = ((self.tokens < VOCAB // 2).sum(1) > LENGTH // 2).long()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.tokens[index], self.labels[index]


def layers(count=4):  # a stock nn.TransformerEncoder's layers, alike
    layer = nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, count, enable_nested_tensor=False).layers


class Mean(nn.Module):  # over the sequence
    def forward(self, x):
        return x.mean(1)


class Encoder(nn.Module):  # all in blocks, run in order: the pipeline's kind
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(
            nn.Embedding(VOCAB, WIDTH), *layers(), Mean(), nn.Linear(WIDTH, 2)
        )

    def forward(self, x):
        return self.blocks(x)


class EmbedOutside(nn.Module):  # the embedding outside blocks
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(*layers(), Mean(), nn.Linear(WIDTH, 2))

    def forward(self, x):
        return self.blocks(self.embed(x))


class Output(dict):  # a Hugging Face ModelOutput's kind: a dict whose keys are attributes too
    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class BertModel(nn.Module):  # Hugging Face's layout: the layers in bert.encoder.layer
    def __init__(self):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, WIDTH)
        self.encoder = nn.Module()
        self.encoder.layer = layers()

    def forward(self, x):
        x = self.embeddings(x)
        for layer in self.encoder.layer:
            x = layer(x)
        return x


class Bert(nn.Module):  # returns a ModelOutput
    def __init__(self):
        super().__init__()
        self.bert, self.classifier = BertModel(), nn.Linear(WIDTH, 2)

    def forward(self, x):
        return Output(logits=self.classifier(self.bert(x).mean(1)))


class Tuple(Bert):  # returns a tuple (a Hugging Face model with return_dict=False)
    def forward(self, x):
        return tuple(super().forward(x).values())


class Logits(Bert):  # the README's way: the logits alone
    def forward(self, x):
        return super().forward(x).logits


Net = globals()[os.environ.get("NET", "Encoder")]
