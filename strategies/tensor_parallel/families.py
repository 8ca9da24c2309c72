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
from strategies.tensor_parallel.plans import FUSED_QKV_PLAN, SEPARATE_QKV_PLAN, Colwise, Rowwise, Style, matches


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
    """The linear layers inside a list of blocks (a part of their name is an index)."""
    return [name for name in linears(model) if any(part.isdigit() for part in name.split("."))]


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
