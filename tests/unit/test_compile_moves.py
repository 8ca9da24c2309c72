"""Moving a user's own compile to the blocks (`strategies.compile`), without compiling anything: what is found,
what is kept, and what is put back."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.eval_frame import _TorchDynamoContext

from strategies.compile import compile_blocks, compiler


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_compiled_model_without_a_list_of_blocks_keeps_its_own_compile_and_an_explicit_option_says_why():
    root = nn.Module()
    root.model = torch.compile(nn.Sequential(nn.Linear(4, 4)), backend="eager")  # one element: not a block list
    forward = vars(root.model)["forward"]
    assert compile_blocks(root, False) is None
    assert vars(root.model)["forward"] is forward  # left compiled whole, as before the pack moved compiles
    with pytest.raises(ValueError, match="compiles the model one block at a time, and found no list of blocks"):
        compile_blocks(root, True)
    assert vars(root.model)["forward"] is forward


def test_module_compile_settings_go_to_the_blocks_and_teardown_puts_everything_back_once():
    model = Blocks()
    model.compile(backend="aot_eager", mode=None)
    impl = model._compiled_call_impl
    compile_fn, undo = compiler(False, model)
    assert isinstance(compile_fn, _TorchDynamoContext)  # the user's context (backend, mode), not bare defaults
    undo()
    assert model._compiled_call_impl is impl
    compiled = compile_blocks(model, False)
    assert model._compiled_call_impl is None and all("forward" in vars(b) for b in model.layers)
    compiled.teardown(True)
    assert model._compiled_call_impl is impl and not any("forward" in vars(b) for b in model.layers)
    model.layers[0].forward = marker = lambda x: x  # a second teardown must not touch what came after
    compiled.teardown(True)
    assert model.layers[0].forward is marker and model._compiled_call_impl is impl
