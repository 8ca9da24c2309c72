"""A Hugging Face ``LlamaForCausalLM`` from a random config (nothing downloaded) on random tokens, as a `stratpack`
workload (registered as ``hf-llama``): the model people bring, at any size the command line gives, for
`stratpack train` and `stratpack bench --accelerator gpu`. GQA with 4 key/value heads, a 32k vocabulary, an MLP 4x
wide (``intermediate_size``), untied embeddings: the shape of Llama 2/3 at small sizes."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from strategies.cli.workload import needs

VOCAB, KV_HEADS = 32000, 4


class RandomTokens(Dataset):
    """``(x, y)`` next-token pairs of fixed random ids (no corpus needed)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0) -> None:
        self.ids = torch.randint(vocab, (n, seq_len + 1), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i, :-1], self.ids[i, 1:]


class LlamaModule(L.LightningModule):
    """The Llama and its loss, written as for one device; fused AdamW on a GPU, as the demo GPT."""

    def __init__(self, n_layer: int, n_embd: int, n_head: int, seq_len: int, lr: float = 3e-4) -> None:
        super().__init__()
        transformers = needs("transformers", "models", "the hf-llama workload")
        self.config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=n_embd, intermediate_size=4 * n_embd, num_hidden_layers=n_layer,
            num_attention_heads=n_head, num_key_value_heads=min(KV_HEADS, n_head), max_position_embeddings=seq_len)
        self.model = transformers.LlamaForCausalLM(self.config)
        self.tokens_per_sample, self.lr = seq_len, lr
        self.shape = (n_layer, n_embd, seq_len)

    def compute_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.compute_loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95),
                                 fused=self.device.type == "cuda" or None)

    def flops_per_token(self) -> int:
        """6N + 12·L·h·s, N without the input embedding (a lookup)."""
        layers, hidden, seq = self.shape
        lookup = self.model.get_input_embeddings().weight.numel()
        return 6 * (sum(p.numel() for p in self.parameters()) - lookup) + 12 * layers * hidden * seq


class LlamaWorkload:
    """`stratpack train --workload hf-llama` (or ``demos.hf_llama:LLAMA`` where the pack is not installed)."""

    def lightning(self, config: Any) -> tuple[Any, Any]:
        n = max(config.steps, 1) * config.batch_size * config.accumulate
        module = LlamaModule(config.n_layer, config.n_embd, config.n_head, config.seq_len, lr=config.lr)
        return module, RandomTokens(n, config.seq_len, VOCAB, seed=config.seed)

    def model_config(self, config: Any) -> dict[str, Any]:
        return {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": config.n_embd,
                "intermediate_size": 4 * config.n_embd, "num_hidden_layers": config.n_layer,
                "num_attention_heads": config.n_head, "num_key_value_heads": min(KV_HEADS, config.n_head),
                "seq_len": config.seq_len}


LLAMA = LlamaWorkload()
