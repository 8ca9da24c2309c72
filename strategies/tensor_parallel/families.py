"""The model families tensor parallel splits without being told how, detected from the module structure.

A family is a plan (`plans`: which layers split, and how) for one layout of decoder blocks. `detect_plan` takes
the family whose plan covers *every* linear layer inside the model's lists of blocks: a split of only some layers
of a block would leave the rest computing on a width they no longer have, so a layout that is matched in part is
refused, naming the layers no plan understood. Layers outside the blocks (embeddings, the output head) stay whole.

The fused q|k|v layouts differ, and a wrong one would train without an error, so each is tied to what produces
it: GPT-2 and nanoGPT ``c_attn`` is [q | k | v] (three equal blocks), GPT-NeoX ``query_key_value`` interleaves
per head (q, k, v of head 0, then of head 1: whole heads are contiguous, one block), Phi-3 ``qkv_proj`` is [q | k | v]
with fewer k/v heads (three blocks of the sizes its config gives). A ``query_key_value`` or ``qkv_proj`` of
another model type is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from strategies.tensor_parallel.layers import is_conv1d
from strategies.tensor_parallel.plans import (
    FUSED_QKV_PLAN,
    SEPARATE_QKV_PLAN,
    Colwise,
    Rowwise,
    Style,
    VocabEmbedding,
    VocabHead,
    matches,
)


@dataclass(frozen=True)
class Family:
    """A layout of decoder blocks: ``plan(model)`` gives its plan; ``model_types``: the Hugging Face
    ``config.model_type`` values it holds for, when the layout alone is ambiguous (empty: any)."""

    name: str
    plan: Callable[[nn.Module], dict[str, Style]]
    model_types: tuple[str, ...] = ()


def _fixed(plan: dict[str, Style]) -> Callable[[nn.Module], dict[str, Style]]:
    return lambda model: plan


def _phi3_plan(model: nn.Module) -> dict[str, Style]:
    config = model_config(model)
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {"*.qkv_proj": Colwise(chunks=(heads * head_dim, kv * head_dim, kv * head_dim)), "*.o_proj": Rowwise(),
            "*.gate_up_proj": Colwise(chunks=2), "*.down_proj": Rowwise()}


GPT2_PLAN: dict[str, Style] = {
    "*.attn.c_attn": Colwise(chunks=3), "*.attn.c_proj": Rowwise(), "*.mlp.c_fc": Colwise(), "*.mlp.c_proj": Rowwise()}
OPT_PLAN: dict[str, Style] = {
    "*.q_proj": Colwise(), "*.k_proj": Colwise(), "*.v_proj": Colwise(), "*.out_proj": Rowwise(),
    "*.fc1": Colwise(), "*.fc2": Rowwise()}
GPTJ_PLAN: dict[str, Style] = {
    "*.q_proj": Colwise(), "*.k_proj": Colwise(), "*.v_proj": Colwise(), "*.out_proj": Rowwise(),
    "*.mlp.fc_in": Colwise(), "*.mlp.fc_out": Rowwise()}
NEOX_PLAN: dict[str, Style] = {
    "*.attention.query_key_value": Colwise(), "*.attention.dense": Rowwise(),
    "*.mlp.dense_h_to_4h": Colwise(), "*.mlp.dense_4h_to_h": Rowwise()}

FAMILIES = (
    Family("the pack's demo GPT (qkv / proj / fc)", _fixed(FUSED_QKV_PLAN)),
    Family("Llama / Mistral / Qwen2 / Gemma (q/k/v/o_proj, gate/up/down_proj)", _fixed(SEPARATE_QKV_PLAN)),
    Family("GPT-2 / nanoGPT (c_attn, c_proj, c_fc)", _fixed(GPT2_PLAN)),
    Family("OPT / BART (q/k/v_proj, out_proj, fc1/fc2)", _fixed(OPT_PLAN)),
    Family("GPT-J (q/k/v_proj, out_proj, fc_in/fc_out)", _fixed(GPTJ_PLAN)),
    Family("GPT-NeoX / Pythia (query_key_value, dense)", _fixed(NEOX_PLAN), model_types=("gpt_neox",)),
    Family("Phi-3 (qkv_proj, gate_up_proj)", _phi3_plan, model_types=("phi3",)),
)

_EXAMPLE = "{'*.attn.qkv': Colwise(chunks=3), '*.attn.proj': Rowwise(), '*.mlp.fc': Colwise(), '*.mlp.proj': Rowwise()}"


def model_config(model: nn.Module):
    """The first Hugging Face style ``config`` (one with ``model_type``) found on ``model`` or its submodules."""
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "model_type"):
            return config
    return None


def linears(model: nn.Module) -> list[str]:
    """Names of the linear layers (``nn.Linear`` or ``Conv1D``) of ``model``."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) or is_conv1d(m)]


def block_linears(model: nn.Module) -> list[str]:
    """The linear layers inside a list of blocks (a part of their name is an index), but a mixture-of-experts
    router: it reads the whole width (the row-parallel layer before it all-reduces), and stays whole."""
    return [name for name in linears(model) if any(part.isdigit() for part in name.split("."))
            and not _is_router(model, name)]


def _is_router(model: nn.Module, name: str) -> bool:
    parent, _, last = name.rpartition(".")
    return last in ("gate", "router", "shared_expert_gate") and hasattr(model.get_submodule(parent), "experts")


def detect_plan(model: nn.Module) -> dict[str, Style]:
    """The plan of the family that splits every linear layer of ``model``'s blocks; a clear error otherwise."""
    inside = block_linears(model)
    config = model_config(model)
    partial: list[tuple[Family, list[str], list[str]]] = []
    for family in FAMILIES:
        if family.model_types and getattr(config, "model_type", None) not in family.model_types:
            continue
        plan = family.plan(model)
        found = [name for name in matches(plan, model)]
        if not found:
            continue
        missing = [name for name in inside if name not in found]
        if not missing:
            return plan
        partial.append((family, found, missing))
    if partial:
        family, found, missing = max(partial, key=lambda item: len(item[1]))
        raise ValueError(
            f"tensor parallel would split only part of this model's blocks: the plan for {family.name} splits "
            f"{len(found)} layers ({', '.join(found[:4])}, ...) but does not understand {len(missing)}: "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}. A partial split would compute on "
            f"widths those layers no longer have. Pass a plan that names every linear layer of a block, e.g. "
            f"PlanStrategy('tp2', tp_plan={_EXAMPLE}) (strategies.Colwise / Rowwise / VocabEmbedding).")
    raise ValueError(
        "no tensor-parallel plan fits this model: the shipped plans cover "
        f"{'; '.join(f.name for f in FAMILIES)}. Linear layers found: {', '.join(linears(model)[:12]) or 'none'}"
        f"{f' (model_type {config.model_type!r})' if config is not None else ''}. Pass a plan, e.g. "
        f"PlanStrategy('tp2', tp_plan={_EXAMPLE}) (strategies.Colwise / Rowwise / VocabEmbedding).")


def vocab_layers(model: nn.Module) -> tuple[str, str | None] | None:
    """``(output layer, input embedding or None)`` of a language model: what a Hugging Face model's
    ``get_output_embeddings`` / ``get_input_embeddings`` return, else the one ``nn.Linear`` outside the blocks whose
    outputs are as many as the rows of an ``nn.Embedding`` outside them (the embedding: the one tied to it, else the
    one such embedding). None when there is no such layer or more than one."""
    names = {id(m): n for n, m in model.named_modules()}
    for m in model.modules():
        if callable(getattr(m, "get_output_embeddings", None)) and callable(getattr(m, "get_input_embeddings", None)):
            try:  # a Hugging Face model without these (a vision model) raises NotImplementedError
                head = m.get_output_embeddings()
                embedding = m.get_input_embeddings() if isinstance(head, nn.Linear) else None
            except (NotImplementedError, AttributeError):
                continue
            if isinstance(head, nn.Linear) and id(head) in names:
                return names[id(head)], names.get(id(embedding)) if isinstance(embedding, nn.Embedding) else None
    outside = [(n, m) for n, m in model.named_modules() if not any(part.isdigit() for part in n.split("."))]
    embeddings = [(n, m) for n, m in outside if isinstance(m, nn.Embedding)]
    heads = [(n, m) for n, m in outside if isinstance(m, nn.Linear)
             and any(e.num_embeddings == m.out_features for _, e in embeddings)]
    if len(heads) != 1:
        return None
    head_name, head = heads[0]
    tied = [n for n, e in embeddings if e.weight is head.weight]
    same = [n for n, e in embeddings if e.num_embeddings == head.out_features]
    candidates = tied or same
    return head_name, candidates[0] if len(candidates) == 1 else None


def vocab_plan(model: nn.Module, tp: int) -> dict[str, Style]:
    """The rules of 'vp': the output layer split over the vocabulary (`VocabHead`), and its input embedding
    (`VocabEmbedding`) when there is one; a clear error when the model has no such layer or its vocabulary does not
    divide by tp."""
    found = vocab_layers(model)
    if found is None:
        raise ValueError("vp (vocab parallel) splits the output layer over the vocabulary, but this model has no "
                         "single output layer to split: an nn.Linear outside the blocks with as many outputs as an "
                         "nn.Embedding has rows (or a Hugging Face get_output_embeddings()). Name it in tp_plan "
                         "with VocabHead(), e.g. {'lm_head': VocabHead(), 'embed': VocabEmbedding(), ...}, or drop vp.")
    head, embedding = found
    vocab = model.get_submodule(head).out_features
    if vocab % tp:
        raise ValueError(f"vp (vocab parallel): the vocabulary of {head} ({vocab}) does not divide by tp = {tp}; "
                         f"pad it to a multiple of tp (e.g. {-(-vocab // (tp * 64)) * tp * 64}), or drop vp")
    if embedding is not None and not _plain_embedding(model.get_submodule(embedding)):
        if model.get_submodule(embedding).weight is model.get_submodule(head).weight:
            raise ValueError(f"vp (vocab parallel): {embedding} is tied to {head}, but it is not a plain nn.Embedding "
                             f"({type(model.get_submodule(embedding)).__name__}: its own forward, or max_norm), so its "
                             "split would compute something else; drop vp for this model")
        embedding = None  # untied: split the head only, keep this embedding whole
    return {head: VocabHead()} | ({embedding: VocabEmbedding()} if embedding is not None else {})


def _plain_embedding(embedding: nn.Module) -> bool:
    """Whether the vocabulary split (`VocabParallelEmbedding`: a lookup, ``padding_idx`` kept) computes what
    ``embedding`` does: an ``nn.Embedding`` with torch's own forward (Gemma's scales its output) and no max_norm."""
    return (isinstance(embedding, nn.Embedding) and type(embedding).forward is nn.Embedding.forward
            and embedding.max_norm is None and not embedding.sparse)
