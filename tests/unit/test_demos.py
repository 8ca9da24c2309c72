"""Fast, single-process checks of the demo model and data (no downloads)."""

import math

import pytest
import torch

from demos import (
    GPT,
    CharDataset,
    CharTokenizer,
    GPTConfig,
    GPTModule,
    load_corpus,
    make_demo,
)

TEXT = "hello world, this is a tiny corpus for tests.\n" * 20


def tiny_config(vocab_size: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab_size, n_layer=1, n_head=2, n_embd=32, seq_len=16)


def test_tokenizer_round_trip():
    tok = CharTokenizer(TEXT)
    ids = tok.encode(TEXT)
    assert ids.dtype == torch.long and ids.shape == (len(TEXT),)
    assert tok.vocab_size == len(set(TEXT))
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids.tolist()) == TEXT
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("Z")


def test_dataset_items_are_shifted_windows():
    data = torch.arange(101)
    ds = CharDataset(data, seq_len=10)
    assert len(ds) == (101 - 1) // 10
    x, y = ds[3]
    assert x.dtype == y.dtype == torch.long
    assert x.shape == y.shape == (10,)
    assert torch.equal(x, torch.arange(30, 40))
    assert torch.equal(y, x + 1)
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(ValueError, match="too short"):
        CharDataset(torch.arange(5), seq_len=10)


def test_logits_shape():
    torch.manual_seed(0)
    cfg = tiny_config(vocab_size=50)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    assert model(idx).shape == (3, cfg.seq_len, cfg.vocab_size)
    # Shorter sequences are fine; longer than seq_len are rejected.
    assert model(idx[:, :5]).shape == (3, 5, cfg.vocab_size)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, cfg.seq_len + 1, dtype=torch.long))


def test_module_layout_and_init_are_deterministic():
    torch.manual_seed(0)
    a = GPT(tiny_config(20))
    torch.manual_seed(0)
    b = GPT(tiny_config(20))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert a.head.weight.data_ptr() != a.tok_emb.weight.data_ptr()  # untied
    assert a.blocks[0].attn.qkv.out_features == 3 * 32
    assert a.blocks[0].mlp.fc.out_features == 4 * 32
    assert torch.all(a.blocks[0].mlp.fc.bias == 0)


def test_initial_loss_close_to_uniform():
    torch.manual_seed(0)
    module, ds = make_demo(TEXT, n_layer=1, n_embd=32, seq_len=16)
    x, y = torch.stack([ds[i][0] for i in range(4)]), torch.stack([ds[i][1] for i in range(4)])
    loss = module.compute_loss((x, y)).item()
    assert abs(loss - math.log(module.config.vocab_size)) < 0.3


def test_training_steps_reduce_loss_on_fixed_batch():
    torch.manual_seed(0)
    module, ds = make_demo(TEXT, n_layer=1, n_embd=32, seq_len=16)
    batch = (torch.stack([ds[i][0] for i in range(4)]), torch.stack([ds[i][1] for i in range(4)]))
    opt = module.configure_optimizers()
    assert isinstance(opt, torch.optim.AdamW)
    first = module.compute_loss(batch).item()
    for _ in range(10):
        opt.zero_grad()
        module.compute_loss(batch).backward()
        opt.step()
    assert module.compute_loss(batch).item() < first - 0.5


def test_module_hparams_and_flops():
    cfg = tiny_config(40)
    module = GPTModule(cfg, lr=1e-3, weight_decay=0.1)
    assert module.hparams.lr == 1e-3 and module.hparams.weight_decay == 0.1
    assert module.tokens_per_sample == cfg.seq_len
    n = module.model.num_params() - cfg.seq_len * cfg.n_embd
    assert module.model.num_params(exclude_pos_emb=True) == n
    assert module.flops_per_token() == 6 * n + 12 * cfg.n_layer * cfg.n_embd * cfg.seq_len
    assert GPTModule().config == GPTConfig()


def test_default_corpus_is_nonempty_and_deterministic():
    a = load_corpus()
    assert len(a) > 10_000
    assert a == load_corpus()
    assert load_corpus(max_chars=1000) == a[:1000]


def test_make_demo_with_default_corpus():
    module, ds = make_demo(max_chars=5_000, seq_len=32)
    assert len(ds) == (5_000 - 1) // 32
    assert module.config.vocab_size == module.tokenizer.vocab_size


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n_embd": 30, "n_head": 4}, "n_embd"),
        ({"n_layer": 0}, "n_layer"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"seq_len": 0}, "seq_len"),
        ({"dropout": 1.0}, "dropout"),
    ],
)
def test_bad_config_raises(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GPTConfig(**kwargs)


def test_missing_or_empty_data_file_gives_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data"):
        load_corpus(str(tmp_path / "nope.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(str(empty))
    good = tmp_path / "good.txt"
    good.write_bytes(b"abc\xffdef")  # invalid UTF-8 is replaced, not fatal
    assert load_corpus(str(good)) == "abc\ufffddef"
