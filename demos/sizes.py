"""Models at the sizes people train, as workloads (`strategies.cli.workload`), for `stratpack rehearse` and the
planner's checks: Hugging Face configs written out here from the published model cards (nothing downloaded), built
in ``configure_model`` (on meta under the pack's plans), trained on random token ids of ``--seq-len``.

Registered in pyproject's ``stratpack.workloads``: ``llama3-8b``, ``llama3-70b``, ``llama3-405b``, ``qwen2-7b``,
``gpt2-xl``; ``hf-config``: the model of the user's own ``config.json`` (``--hf-config PATH``). ``--n-layer`` other
than the default (0) keeps the width and cuts the depth (a quick look at a shape).
And ``gpt-shape``: the demo GPT at the shape the run's options give (``--n-layer --n-embd --n-head --seq-len
--vocab``), the block the estimator models, what `stratpack plan --rehearse` rehearses a model known by its size as.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch

from strategies.cli.workload import needs

# (transformers class names, config) per model: Llama 3 (Meta, 2024, model cards), Qwen2 (Alibaba, 2024), GPT-2 XL.
_LLAMA3 = {"vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
           "num_key_value_heads": 8, "tie_word_embeddings": False}
CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama3-8b": ("LlamaConfig", "LlamaForCausalLM", {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336,
                                                      "num_hidden_layers": 32, "num_attention_heads": 32}),
    "llama3-70b": ("LlamaConfig", "LlamaForCausalLM", {**_LLAMA3, "hidden_size": 8192, "intermediate_size": 28672,
                                                       "num_hidden_layers": 80, "num_attention_heads": 64}),
    "llama3-405b": ("LlamaConfig", "LlamaForCausalLM", {**_LLAMA3, "hidden_size": 16384,
                                                        "intermediate_size": 53248, "num_hidden_layers": 126,
                                                        "num_attention_heads": 128}),
    "qwen2-7b": ("Qwen2Config", "Qwen2ForCausalLM", {"vocab_size": 152064, "hidden_size": 3584,
                                                     "intermediate_size": 18944, "num_hidden_layers": 28,
                                                     "num_attention_heads": 28, "num_key_value_heads": 4,
                                                     "max_position_embeddings": 32768, "tie_word_embeddings": False}),
    "gpt2-xl": ("GPT2Config", "GPT2LMHeadModel", {"vocab_size": 50257, "n_embd": 1600, "n_layer": 48, "n_head": 25,
                                                  "n_positions": 1024, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                                  "attn_pdrop": 0.0}),
}


def hf_config(name: str, n_layer: int = 0, path: str | None = None) -> Any:
    """The ``transformers`` config of ``name``, or of the ``config.json`` at ``path`` (a file, or a folder that has
    one; read here, nothing downloaded), with SDPA attention, ``n_layer`` blocks deep where given."""
    transformers = needs("transformers", "models", f"the {name} workload")
    if path is not None:
        if not os.path.exists(path):
            raise ValueError(f"--hf-config {path}: no such file or folder (give a config.json, or its folder)")
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    else:
        config_cls, _, values = CONFIGS[name]
        config = getattr(transformers, config_cls)(**values)
    if n_layer:
        setattr(config, "n_layer" if hasattr(config, "n_layer") else "num_hidden_layers", n_layer)
    config._attn_implementation = "sdpa"
    return config


class CausalLMModule(L.LightningModule):
    """A Hugging Face causal LM of ``name``, built in configure_model, trained on next-token loss."""

    def __init__(self, name: str, n_layer: int = 0, lr: float = 3e-4, optimizer: str = "adamw",
                 path: str | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.name, self.lr, self.optimizer_name = name, lr, optimizer
        self.config = hf_config(name, n_layer, path)
        self.config.use_cache = False  # training: no key/value cache (on by default, it keeps every block's K and V)
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            transformers = needs("transformers", "models", f"the {self.name} workload")
            # in the default dtype (Lightning's precision sets it), not a config.json's own ("bfloat16" in Llama 3's)
            self.model = transformers.AutoModelForCausalLM.from_config(self.config, dtype=torch.get_default_dtype())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids = batch[0]
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name.startswith("sgd"):
            momentum = 0.9 if self.optimizer_name == "sgd" else 0.0
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=momentum)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1)


@dataclass(frozen=True)
class SizedWorkload:
    """A `Workload` of one of `CONFIGS` (`stratpack train/rehearse --workload llama3-70b`), or with ``name``
    ``hf-config`` the model of the run's ``--hf-config`` (``config.hf_config``)."""

    name: str
    extra: dict = field(default_factory=dict)

    def _path(self, config: Any) -> str | None:
        if self.name not in CONFIGS and not getattr(config, "hf_config", None):
            raise ValueError(f"the {self.name} workload builds the model of a config.json: give --hf-config PATH")
        return None if self.name in CONFIGS else config.hf_config

    def lightning(self, config: Any) -> tuple[Any, Any]:
        module = CausalLMModule(self.name, n_layer=_depth(config), lr=config.lr, optimizer=config.optimizer,
                                path=self._path(config))
        vocab = module.config.vocab_size
        samples = config.batch_size * config.accumulate * max(config.steps, 1)
        ids = torch.randint(vocab, (samples, config.seq_len), generator=torch.Generator().manual_seed(config.seed))
        return module, torch.utils.data.TensorDataset(ids)

    def model_config(self, config: Any) -> dict[str, Any]:
        return hf_config(self.name, _depth(config), self._path(config)).to_dict()


def _depth(config: Any) -> int:
    """``--n-layer`` where the user changed it from the run's default, else the model's own depth (0)."""
    from strategies.cli.train import RunConfig

    return 0 if config.n_layer == RunConfig().n_layer else config.n_layer


LLAMA3_8B, LLAMA3_70B = SizedWorkload("llama3-8b"), SizedWorkload("llama3-70b")
LLAMA3_405B = SizedWorkload("llama3-405b")
QWEN2_7B, GPT2_XL = SizedWorkload("qwen2-7b"), SizedWorkload("gpt2-xl")
HF_CONFIG = SizedWorkload("hf-config")


@dataclass(frozen=True)
class GPTShapeWorkload:
    """The demo GPT at ``config``'s shape (its vocabulary ``config.vocab``), built in configure_model, on random ids."""

    def lightning(self, config: Any) -> tuple[Any, Any]:
        from demos.gpt import GPTConfig, GPTModule

        shape = GPTConfig(vocab_size=config.vocab or 32000, n_layer=config.n_layer, n_head=config.n_head,
                          n_embd=config.n_embd, seq_len=config.seq_len)
        module = GPTModule(shape, lr=config.lr, optimizer=config.optimizer, configure_model=True)
        samples = config.batch_size * config.accumulate * max(config.steps, 1)
        ids = torch.randint(shape.vocab_size, (samples, config.seq_len + 1),
                            generator=torch.Generator().manual_seed(config.seed))
        return module, torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])

    def model_config(self, config: Any) -> dict[str, Any]:
        return {"vocab_size": config.vocab or 32000, "n_layer": config.n_layer, "n_head": config.n_head,
                "n_embd": config.n_embd, "seq_len": config.seq_len}


GPT_SHAPE = GPTShapeWorkload()
