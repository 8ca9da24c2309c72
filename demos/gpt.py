"""A small nanoGPT-style decoder and its LightningModule, used by the demos.

The module layout (attribute names, separate Linear layers, no weight tying)
is part of the public surface: tensor- and pipeline-parallel plans address
submodules by name (``blocks.0.attn.qkv``, ``head``, ...), so keep it stable.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from demos.data import CharDataset, CharTokenizer, load_corpus

OPTIMIZERS = ("adamw", "sgd", "sgd-plain")  # sgd: with momentum; named as the estimator names them


@dataclass
class GPTConfig:
    """Hyperparameters of :class:`GPT`; validated on construction."""

    vocab_size: int = 128
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    seq_len: int = 64
    dropout: float = 0.0
    n_experts: int = 0
    """0: every block's MLP is dense; N: a mixture of N experts (MLPs), each token sent to its ``top_k``."""
    top_k: int = 2

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "n_embd", "seq_len"):
            value = getattr(self, name)
            # bool is an int subclass; reject it so ``n_layer=True`` is not "1".
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if isinstance(self.n_experts, bool) or not isinstance(self.n_experts, int) or self.n_experts < 0:
            raise ValueError(f"n_experts must be 0 (dense) or a positive integer, got {self.n_experts!r}")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={self.n_experts}], got {self.top_k!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused ``qkv`` projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Heads are counted from the projection width (``-1``) rather than
        # ``self.n_head`` so a tensor-parallel ``qkv`` shard that holds only
        # some heads (laid out as [q | k | v] per rank) still works unchanged;
        # and the sequence length is read from the projection's output, not
        # from ``x``: under sequence parallel ``x`` holds 1/tp of the sequence
        # and the projection gathers the whole of it.
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        B, T = q.shape[:2]
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network with the usual 4x expansion."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Experts(nn.Module):
    """``n_experts`` MLPs with their weights fused by expert (``fc``: E x 4h x h, ``proj``: E x h x 4h), called with
    the router's choice per token, as Hugging Face's Mixtral and Qwen-MoE experts are."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_experts = config.n_experts
        self.fc = nn.Parameter(torch.empty(config.n_experts, 4 * config.n_embd, config.n_embd))
        self.proj = nn.Parameter(torch.empty(config.n_experts, config.n_embd, 4 * config.n_embd))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02), as the dense MLP's linears (also what a model built on meta is made with)."""
        nn.init.normal_(self.fc, std=0.02)
        nn.init.normal_(self.proj, std=0.02)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            if token.numel():
                y = F.linear(F.gelu(F.linear(x[token], self.fc[e])), self.proj[e])
                out = out.index_add(0, token, y * top_k_weights[token, slot, None])
        return out


class MoE(nn.Module):
    """A mixture-of-experts MLP, dropless: a linear router, softmax, each token's ``top_k`` experts weighted by their
    renormalised probabilities (Mixtral's routing)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.gate = nn.Linear(config.n_embd, config.n_experts, bias=False)
        self.experts = Experts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.gate(flat), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(flat, index, weights).view_as(x)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln1(x))``, ``x + mlp(ln2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = MoE(config) if config.n_experts else MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer mapping token ids ``[B, T]`` to logits ``[B, T, V]``.

    ``head`` is deliberately *not* tied to ``tok_emb``: tensor and pipeline
    parallelism place or shard those two layers differently, which shared
    weights would make awkward.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.seq_len, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size)
        # Fixed init scheme: with the same torch seed every rank/run builds
        # bit-identical weights, which strategy tests compare against.
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2 style: N(0, 0.02) weights and zero biases keep initial logits
        # small, so the initial loss is close to ln(vocab_size).
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.config.seq_len:
            raise ValueError(f"sequence length {T} exceeds config.seq_len={self.config.seq_len}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def num_params(self, exclude_pos_emb: bool = False) -> int:
        """Count parameters; optionally leave out the position embedding."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_pos_emb:
            n -= self.pos_emb.weight.numel()
        return n


class GPTModule(L.LightningModule):
    """Lightning wrapper: next-token cross-entropy training with AdamW."""

    def __init__(
        self, config: GPTConfig | dict | None = None, lr: float = 3e-3, weight_decay: float = 0.0,
        optimizer: str = "adamw", configure_model: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(config, dict):  # as saved in a checkpoint's hyperparameters
            config = GPTConfig(**config)
        config = config if config is not None else GPTConfig()
        # Plain data only: checkpoints load with torch.load(weights_only=True), which refuses custom classes.
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
        self.save_hyperparameters(
            {"config": asdict(config), "lr": lr, "weight_decay": weight_decay, "optimizer": optimizer,
             "configure_model": configure_model}
        )
        self.optimizer_name = optimizer
        self.config = config
        self.lr = lr
        self.weight_decay = weight_decay
        # configure_model=True: built in configure_model, where a strategy decides where the weights go (the pack's
        # plans: on the meta device, each rank making only its slice; docs/larger-models.md).
        self.model = None if configure_model else GPT(config)
        # Used by throughput callbacks to turn samples/s into tokens/s.
        self.tokens_per_sample = config.seq_len

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(self.config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def compute_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy over every token of the batch."""
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.compute_loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.compute_loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name.startswith("sgd"):  # not scale-invariant like Adam: shows what clipping does
            momentum = 0.9 if self.optimizer_name == "sgd" else 0.0  # sgd-plain: no state (the least memory)
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=momentum, weight_decay=self.weight_decay)
        # Fused on GPUs (one kernel for all tensors, as fast loops use); the for-loop version elsewhere, where the
        # equivalence tests compare against it.
        return torch.optim.AdamW(
            self.parameters(), lr=self.lr, weight_decay=self.weight_decay, betas=(0.9, 0.95),
            fused=self.device.type == "cuda" or None,
        )

    def flops_per_token(self) -> int:
        """Approximate training FLOPs (forward + backward) per token.

        Uses the standard estimate (Kaplan et al. 2020; PaLM appendix B)::

            6 * N + 12 * n_layer * n_embd * seq_len

        ``6 * N`` covers the matmuls with the weights (2 FLOPs per multiply-add,
        times 3 for forward + backward); ``N`` counts all parameters except
        ``pos_emb``, which is a lookup rather than a matmul (``tok_emb`` is kept,
        matching the common convention for untied heads). The second term is
        the attention score and weighted-sum matmuls, which have no weights.
        """
        c = self.config
        n = self.model.num_params(exclude_pos_emb=True)
        if c.n_experts:  # a token runs through top_k experts of each block's n_experts
            n -= c.n_layer * (c.n_experts - c.top_k) * 8 * c.n_embd * c.n_embd  # (fc and proj: 4h x h each)
        return 6 * n + 12 * c.n_layer * c.n_embd * c.seq_len


def make_demo(
    text: str | None = None,
    *,
    n_layer: int = 2,
    n_head: int = 2,
    n_embd: int = 64,
    seq_len: int = 64,
    max_chars: int | None = 200_000,
    lr: float = 3e-3,
    optimizer: str = "adamw",
    configure_model: bool = False,
    n_experts: int = 0, top_k: int = 2,
) -> tuple[GPTModule, CharDataset]:
    """Build a ready-to-train ``(module, dataset)`` pair.

    ``text`` is the training text itself (use :func:`load_corpus` to read a
    file); ``None`` uses the built-in offline corpus. Both are truncated to
    ``max_chars``. The vocabulary size comes from the tokenizer, which is
    also attached as ``module.tokenizer`` for decoding samples. ``configure_model``: the module builds its
    GPT in ``configure_model`` (see `GPTModule`); ``n_experts``: its MLPs a mixture of that many experts, each token
    sent to ``top_k`` (`MoE`).
    """
    if text is None:
        text = load_corpus(max_chars=max_chars)
    elif max_chars is not None:
        text = text[:max_chars]
    tokenizer = CharTokenizer(text)
    dataset = CharDataset(tokenizer.encode(text), seq_len)
    config = GPTConfig(
        vocab_size=tokenizer.vocab_size,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        seq_len=seq_len,
        n_experts=n_experts, top_k=top_k,
    )
    module = GPTModule(config, lr=lr, optimizer=optimizer, configure_model=configure_model)
    module.tokenizer = tokenizer
    return module, dataset


__all__ = ["GPTConfig", "CausalSelfAttention", "MLP", "Experts", "MoE", "Block", "GPT", "GPTModule", "make_demo"]
