"""The demo GPT as a `stratpack` workload (registered as ``gpt`` in pyproject's ``stratpack.workloads``): what
`stratpack train`, `compare` and `bench` train unless told otherwise."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from demos.data import CharDataset, CharTokenizer, load_corpus
from demos.gpt import GPT, GPTConfig, make_demo

BENCH_CHARS = 200_000  # the bench's corpus: the same text for every run


@functools.cache
def _bench_text() -> tuple[CharTokenizer, str]:
    text = load_corpus(max_chars=BENCH_CHARS)
    return CharTokenizer(text), text


class _Stage(nn.Module):
    """Blocks of the GPT as one module: the embeddings before them on the first stage, the head after on the last."""

    def __init__(self, model: GPT, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.blocks = nn.ModuleList(model.blocks[blocks.start : blocks.stop])
        if first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        if last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


class GPTWorkload:
    """The char-level demo GPT on text that needs no download (`demos.data`)."""

    def lightning(self, config: Any) -> tuple[Any, Any]:
        text = load_corpus(config.data, max_chars=config.max_chars) if config.data else None
        return make_demo(text, n_layer=config.n_layer, n_head=config.n_head, n_embd=config.n_embd,
                         seq_len=config.seq_len, max_chars=config.max_chars, lr=config.lr, optimizer=config.optimizer,
                         configure_model=getattr(config, "configure_model", False),
                         n_experts=getattr(config, "experts", 0), top_k=getattr(config, "top_k", 2))

    def model_config(self, config: Any) -> dict[str, Any]:
        experts = getattr(config, "experts", 0)
        return {"vocab_size": _bench_text()[0].vocab_size, "n_layer": config.n_layer, "n_head": config.n_head,
                "n_embd": config.n_embd, "seq_len": config.seq_len,
                **({"n_experts": experts, "top_k": config.top_k} if experts else {})}

    def bench_model(self, config: Any) -> nn.Module:
        torch.manual_seed(config.seed)
        return GPT(GPTConfig(**self.model_config(config)))

    def bench_batches(self, config: Any, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        tokenizer, text = _bench_text()
        data = CharDataset(tokenizer.encode(text), config.seq_len)
        g = torch.Generator().manual_seed(config.seed + 1)
        batches = []
        for _ in range(config.steps):
            idx = torch.randint(len(data), (config.batch_per_rank * config.world_size,), generator=g)
            idx = idx[rank * config.batch_per_rank : (rank + 1) * config.batch_per_rank]
            xs, ys = zip(*(data[int(i)] for i in idx))
            batches.append((torch.stack(xs), torch.stack(ys)))
        return batches

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over every position."""
        return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def pipeline_stage(self, model: GPT, blocks: range, first: bool, last: bool) -> nn.Module:
        return _Stage(model, blocks, first, last)


GPT_WORKLOAD = GPTWorkload()
