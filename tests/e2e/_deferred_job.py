"""Models built in ``configure_model`` (on the meta device, made by slice) under several plans, through the Trainer in
one set of 8 processes: ``python _deferred_job.py OUT``. Rank 0 writes, for each case, the whole model's weights as
training starts (`PlanStrategy.lightning_module_state_dict`) and after `STEPS` steps of plain SGD to OUT. The global
batch is `BATCH` under every plan (each rank takes BATCH / dp), so every case sees one process's batches."""

import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import strategies
from demos.gpt import GPT, GPTConfig
from tests.models import zoo

# The demo under every kind of slicing (ZeRO-3 units, tp layers, pp stages, all three); Hugging Face Llama untied and
# tied (its head and embedding one parameter) under the plans that make them by slice.
CASES = [("demo", "zero3"), ("demo", "tp2"), ("demo", "pp2_1f1b_mb2"), ("demo", "zero3_tp2_pp2_1f1b_mb2"),
         ("llama", "zero3_tp2_pp2_1f1b_mb2"), ("llama", "tp2"), ("llama_tied", "zero3"), ("llama_tied", "pp2_1f1b_mb2")]
DEVICES, STEPS, BATCH, LR = 8, 2, 8, 0.5
DEMO = GPTConfig(n_layer=2, n_head=4, n_embd=zoo.WIDTH, seq_len=zoo.SEQ, vocab_size=zoo.VOCAB, dropout=0.0)


class Built(L.LightningModule):
    """Builds its network in configure_model, as users of large models do; ``loss(ids)`` as the zoo's."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.net = name, None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = GPT(DEMO) if self.name == "demo" else zoo.MODELS[self.name]()

    def training_step(self, batch, index):
        ids = batch[0]
        if self.name != "demo":
            loss = self.net.loss(ids)
        else:
            logits = self.net(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
        self.log("loss", loss.item())  # a value read, as users' steps do (under pp: first traced on meta tensors)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class First(L.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # Before the first step: under pp a meta-built model is cut and made in the first batch
        if hasattr(self, "state"):
            return
        self.state = {k: v.clone() for k, v in trainer.strategy.full_state().items()}

    def on_train_end(self, trainer, pl_module) -> None:  # after fit, a model built on meta is left in slices
        self.last = {k: v.clone() for k, v in trainer.strategy.full_state().items()}


def data() -> TensorDataset:
    return TensorDataset(torch.cat(zoo.batches(STEPS, batch=BATCH)))


def fit(name: str, plan: str) -> dict[str, dict[str, torch.Tensor]]:
    L.seed_everything(0)  # the seed the weights are made from (PL_GLOBAL_SEED)
    module, first = Built(name), First()
    dp = strategies.ParallelPlan.parse(plan).resolve(DEVICES).dp
    trainer = L.Trainer(accelerator="cpu", devices=DEVICES, strategy=strategies.PlanStrategy(plan), max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[first])
    trainer.fit(module, DataLoader(data(), batch_size=BATCH // dp, drop_last=True))
    try:  # after fit: the module holds no weights (all on meta), and asking for them says why
        trainer.strategy.full_state()
        after = "no error"
    except RuntimeError as error:
        after = str(error)
    return {"first": first.state, "last": first.last, "after_fit": after,
            "left_on_meta": all(p.device.type == "meta" for p in module.parameters())}


def main(world: int = DEVICES) -> dict:
    assert world == DEVICES, world
    return {case: fit(*case) for case in CASES}


if __name__ == "__main__":
    results = main()
    if torch.distributed.get_rank() == 0:  # and the script ends, as a user's does: no barrier, no destroy
        torch.save(results, sys.argv[1])
