"""Tiny models people bring, built from random configs (nothing downloaded): Hugging Face classes, a nanoGPT
written as in nanoGPT's model.py, and layouts the pack must refuse or handle (a head registered before the
blocks). Each builder takes a seed and returns a module whose ``loss(ids)`` is the causal-LM loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HEADS, LAYERS, SEQ = 64, 32, 4, 2, 16
EXPERTS = 4


class CausalLM(nn.Module):
    """A Hugging Face causal LM behind one ``loss(ids)`` (the labels are the ids, shifted inside the model)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss


def _hf(config_cls: str, model_cls: str, **kwargs):
    import transformers

    config = getattr(transformers, config_cls)(**kwargs)
    return CausalLM(getattr(transformers, model_cls)(config))


def _llama_like(config_cls: str, model_cls: str, kv: int = HEADS, tied: bool = False, **extra):
    return _hf(config_cls, model_cls, vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
               num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=kv,
               max_position_embeddings=SEQ * 2, tie_word_embeddings=tied, **extra)


def llama():
    return _llama_like("LlamaConfig", "LlamaForCausalLM")


def llama_tied():
    return _llama_like("LlamaConfig", "LlamaForCausalLM", tied=True)


def llama_gqa():
    return _llama_like("LlamaConfig", "LlamaForCausalLM", kv=2)


def qwen2():
    return _llama_like("Qwen2Config", "Qwen2ForCausalLM", kv=2)


def mistral():
    return _llama_like("MistralConfig", "MistralForCausalLM", kv=2)


def phi3():
    return _llama_like("Phi3Config", "Phi3ForCausalLM", kv=2, pad_token_id=0)


def gpt2():
    return _hf("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
               n_positions=SEQ * 2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def opt():
    return _hf("OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=WIDTH, ffn_dim=2 * WIDTH,
               num_hidden_layers=LAYERS, num_attention_heads=HEADS, max_position_embeddings=SEQ * 2,
               word_embed_proj_dim=WIDTH, dropout=0.0, pad_token_id=1)


def gpt_neox():
    return _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", vocab_size=VOCAB, hidden_size=WIDTH,
               intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               max_position_embeddings=SEQ * 2)


def gptj():
    return _hf("GPTJConfig", "GPTJForCausalLM", vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
               n_positions=SEQ * 2, rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


# nanoGPT (github.com/karpathy/nanoGPT, model.py), its layout and forward as written there, small.
class NanoAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.c_proj = nn.Linear(WIDTH, WIDTH)
        self.attn_dropout, self.resid_dropout = nn.Dropout(0.0), nn.Dropout(0.0)
        self.n_head, self.n_embd, self.dropout = HEADS, WIDTH, 0.0
        self.flash = True

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class NanoMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


# nanoGPT exists to be changed: its attention as users change it. Under tensor parallel each is either run on the
# slice (its forward reads widths from the module), run as nanoGPT's forward where that is proven the same, or refused.
class NanoScaledQ(NanoAttention):
    """Queries scaled before attention (QK scaling), the width still read from the input as nanoGPT does: no forward
    can run it on a slice, and nanoGPT's forward would drop the scaling, so tensor parallel refuses it."""

    q_scale = 1.7

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q * self.q_scale
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class NanoRotary(NanoAttention):
    """Rotary positions on q and k, widths read from the module (``self.n_embd``): its own forward runs on a slice."""

    def __init__(self) -> None:
        super().__init__()
        head = WIDTH // HEADS
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, head, 2).float() / head), persistent=False)

    def _rotate(self, t):  # t: (B, heads, T, head)
        angles = torch.arange(t.shape[2], dtype=t.dtype, device=t.device)[:, None] * self.inv_freq.to(t.dtype)
        cos, sin = angles.cos(), angles.sin()
        even, odd = t[..., 0::2], t[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)

    def forward(self, x):
        B, T, _ = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, self.n_embd // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(self._rotate(q), self._rotate(k), v, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, self.n_embd)))


class NanoNoDropout(nn.Module):
    """nanoGPT's attention without its dropout modules: nanoGPT's forward (proven the same) runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.n_head, self.n_embd = HEADS, WIDTH

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class NanoBlock(nn.Module):
    def __init__(self, attention: type[nn.Module] = NanoAttention) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(WIDTH), attention(), nn.LayerNorm(WIDTH), NanoMLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, attention: type[nn.Module] = NanoAttention) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, WIDTH), wpe=nn.Embedding(SEQ * 2, WIDTH), drop=nn.Dropout(0.0),
            h=nn.ModuleList([NanoBlock(attention) for _ in range(LAYERS)]), ln_f=nn.LayerNorm(WIDTH)))
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does

    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    def loss(self, ids):
        return self(ids, torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -1)], 1))[1]


def nanogpt():
    return NanoGPT()


def nanogpt_scaled_q():
    return NanoGPT(NanoScaledQ)


def nanogpt_rotary():
    return NanoGPT(NanoRotary)


def nanogpt_no_dropout():
    return NanoGPT(NanoNoDropout)


class HeadFirst(nn.Module):
    """Registered out of order: the head before the blocks, the embedding after them (pipeline parallel must give
    each to the stage that uses it, not by registration)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(WIDTH, VOCAB)
        self.norm = nn.LayerNorm(WIDTH)
        self.blocks = nn.ModuleList(NanoBlock() for _ in range(LAYERS))
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)

    def forward(self, ids):
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, ids):
        return F.cross_entropy(self(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def head_first():
    return HeadFirst()


# Mixture-of-experts (#48): 4 experts, each token to its top 2; fused 3-D expert weights called with the router's
# choice (transformers >= 4.57's layout), every layer sparse.
def mixtral():
    return _llama_like("MixtralConfig", "MixtralForCausalLM", num_local_experts=EXPERTS, num_experts_per_tok=2)


def mixtral_aux():  # with the router's load-balancing loss in the loss (Switch Transformer's, 0.1 of it)
    return _llama_like("MixtralConfig", "MixtralForCausalLM", num_local_experts=EXPERTS, num_experts_per_tok=2,
                       output_router_logits=True, router_aux_loss_coef=0.1)


def qwen2_moe():  # plus a shared expert beside the routed ones, gated by a sigmoid
    return _llama_like("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=EXPERTS, num_experts_per_tok=2,
                       moe_intermediate_size=WIDTH, shared_expert_intermediate_size=WIDTH, decoder_sparse_step=1,
                       norm_topk_prob=False)


def olmoe():  # OLMoE: q/k norms, 4 experts top 2 (aux loss off)
    return _llama_like("OlmoeConfig", "OlmoeForCausalLM", num_experts=EXPERTS, num_experts_per_tok=2,
                       output_router_logits=False)


def qwen3_moe():
    return _llama_like("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_experts=EXPERTS, num_experts_per_tok=2,
                       moe_intermediate_size=WIDTH, decoder_sparse_step=1, head_dim=WIDTH // HEADS)


class GptMoe(nn.Module):
    """The demo GPT with its MoE option, behind ``loss(ids)``."""

    def __init__(self) -> None:
        super().__init__()
        from demos.gpt import GPT, GPTConfig

        self.gpt = GPT(GPTConfig(vocab_size=VOCAB, n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH, seq_len=SEQ,
                                 n_experts=EXPERTS, top_k=2))

    def loss(self, ids):
        logits = self.gpt(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def gpt_moe():
    return GptMoe()


MOE = {f.__name__: f for f in (mixtral, mixtral_aux, qwen2_moe, qwen3_moe, olmoe, gpt_moe)}
MODELS = {f.__name__: f for f in (llama, llama_tied, llama_gqa, qwen2, mistral, phi3, gpt2, opt, gpt_neox, gptj,
                                  nanogpt, head_first)}
# nanoGPT as users change it (tensor parallel only): trained equal to one process, or refused naming the module.
VARIANTS = {f.__name__: f for f in (nanogpt_scaled_q, nanogpt_rotary, nanogpt_no_dropout)}
REFUSED_UNDER_TP = {"nanogpt_scaled_q": "transformer.h.0.attn"}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return {**MODELS, **VARIANTS, **MOE}[name]()


def batches(steps: int, batch: int = 4, seed: int = 1, shorter_last: bool = False) -> list[torch.Tensor]:
    """``steps`` batches of token ids; ``shorter_last``: the last two tokens shorter (a pipeline sends its
    activations' shapes again when the batch's change, and not while they stay)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (batch, SEQ - 2 if shorter_last and k == steps - 1 else SEQ), generator=g)
            for k in range(steps)]
