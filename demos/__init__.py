"""Demo model and data for the strategy pack: a tiny char-level GPT, fully offline."""

from demos.data import CharDataset, CharTokenizer, default_corpus, load_corpus
from demos.gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig, GPTModule, make_demo

__all__ = [
    "Block",
    "CausalSelfAttention",
    "CharDataset",
    "CharTokenizer",
    "GPT",
    "GPTConfig",
    "GPTModule",
    "MLP",
    "default_corpus",
    "load_corpus",
    "make_demo",
]
