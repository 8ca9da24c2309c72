"""Lightning integration of the strategy pack, without launching processes.

Building a Trainer with ``devices > 1`` on CPU resolves the strategy, its ranks and its launcher in this
process; processes start only at ``fit``, which these tests never call.
"""

import lightning as L
import pytest
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

import strategies
from strategies.cli import main as cli_main
from strategies.plan import VALID_TOKENS


def make_trainer(strategy, devices, tmp_path):
    return L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )


# -- plan strings as Trainer strategies --------------------------------------------------------------------


def test_dp_is_our_data_parallel_strategy(tmp_path):
    trainer = make_trainer("dp", 2, tmp_path)
    assert type(trainer.strategy) is strategies.DataParallelStrategy
    assert trainer.strategy.world_size == 2
    assert str(trainer.strategy.resolved_plan) == "dp2"


def test_naive_is_the_parameter_server_strategy(tmp_path):
    trainer = make_trainer("naive", 2, tmp_path)
    assert type(trainer.strategy) is strategies.NaiveDataParallelStrategy
    assert str(trainer.strategy.resolved_plan) == "naive_dp2"


def test_dp_with_explicit_degree(tmp_path):
    trainer = make_trainer("dp2", 2, tmp_path)
    assert isinstance(trainer.strategy, strategies.PlanStrategy)
    assert str(trainer.strategy.plan) == "dp2"
    assert trainer.strategy.resolved_plan.dp == 2


@pytest.mark.parametrize("name,resolved", [("sac", "sac"), ("ac2", "ac2"), ("tp2_sac", "dp1_tp2_sac")])
def test_a_plan_of_recompute_tokens_alone_is_ours(tmp_path, name, resolved):
    # (a plan whose every token is a recompute one: the registry once knew only `ac`, and gave these to Lightning)
    trainer = make_trainer(name, 2, tmp_path)
    assert isinstance(trainer.strategy, strategies.PlanStrategy)
    assert str(trainer.strategy.resolved_plan).removeprefix("dp2_") == resolved


def test_upper_case_plan_string(tmp_path):
    trainer = make_trainer("ZERO2_TP2", 4, tmp_path)
    assert str(trainer.strategy.resolved_plan) == "zero2_dp2_tp2"


def test_full_plan_resolves_at_trainer_construction(tmp_path):
    trainer = make_trainer("zero3_tp2_pp2", 8, tmp_path)
    strategy = trainer.strategy
    assert isinstance(strategy, strategies.PlanStrategy)
    assert str(strategy.plan) == "zero3_tp2_pp2"
    assert str(strategy.resolved_plan) == "zero3_dp2_tp2_pp2_mb2"
    assert strategy.world_size == 8 and trainer.world_size == 8
    assert trainer.num_devices == 8


def test_strategy_object(tmp_path):
    strategy = strategies.DataParallelStrategy(bucket_cap_mb=1)
    trainer = make_trainer(strategy, 2, tmp_path)
    assert trainer.strategy is strategy
    assert str(strategy.resolved_plan) == "dp2"
    assert len(strategy.parallel_devices) == 2
    with pytest.raises(ValueError, match="bucket_cap_mb must be > 0"):
        strategies.DataParallelStrategy(bucket_cap_mb=0)


def test_impossible_plan_fails_at_trainer_construction(tmp_path):
    with pytest.raises(ValueError) as info:
        make_trainer("zero3_tp3", 8, tmp_path)
    assert "tp(3) * pp(1) = 3 does not divide world_size 8" in str(info.value)
    with pytest.raises(ValueError, match=r"dp\(2\) \* tp\(1\) \* pp\(1\) = 2 != world_size 4"):
        make_trainer("dp2", 4, tmp_path)


@pytest.mark.parametrize(
    "name, suggestion", [("ddp_tp2", "dp_tp2"), ("fsdp_tp2", "zero3_tp2"), ("deepspeed_stage_3_tp2", "zero3_tp2")]
)
def test_lightning_name_combined_with_plan_tokens_suggests_ours(tmp_path, name, suggestion):
    with pytest.raises(ValueError) as info:
        make_trainer(name, 4, tmp_path)
    assert f"Did you mean '{suggestion}'?" in str(info.value)


def test_bad_token_in_a_plan_gets_our_error(tmp_path):
    with pytest.raises(ValueError) as info:
        make_trainer("zero3_tp2_foo", 4, tmp_path)
    assert "unknown token 'foo'" in str(info.value)
    assert VALID_TOKENS in str(info.value)


# -- Lightning's own names keep their meaning ----------------------------------------------------------------


def test_ddp_is_still_lightnings(tmp_path):
    trainer = make_trainer("ddp", 2, tmp_path)
    assert type(trainer.strategy) is DDPStrategy
    assert not isinstance(trainer.strategy, strategies.PlanStrategy)


def test_ddp_spawn_is_still_lightnings(tmp_path):
    trainer = make_trainer("ddp_spawn", 2, tmp_path)
    assert type(trainer.strategy) is DDPStrategy
    assert trainer.strategy._start_method == "spawn"


def test_unrelated_unknown_name_still_gets_lightnings_error(tmp_path):
    with pytest.raises(ValueError, match="You selected an invalid strategy name: `strategy='foo'`"):
        make_trainer("foo", 2, tmp_path)


def test_registry_membership():
    names = StrategyRegistry.available_strategies()
    assert "ddp" in names and "fsdp" in names and "ddp_spawn" in names
    assert "dp" in names and "naive" in names
    assert "zero2_tp2" in names
    assert "zero3_dp4_tp2_pp2_mb8" in names
    assert "foo" not in names
    assert "ddp_tp2" in names  # claimed, so that the user gets our suggestion


def test_registry_get():
    assert isinstance(StrategyRegistry.get("ddp"), DDPStrategy)
    assert type(StrategyRegistry.get("dp")) is strategies.DataParallelStrategy
    plan_strategy = StrategyRegistry.get("zero2_tp2")
    assert type(plan_strategy) is strategies.PlanStrategy
    assert str(plan_strategy.plan) == "zero2_tp2"
    assert StrategyRegistry.get("foo", "fallback") == "fallback"


def test_install_is_idempotent():
    before = dict(StrategyRegistry)
    strategies.lightning.registry.install()
    assert dict(StrategyRegistry) == before
    assert "zero2_tp2" in StrategyRegistry.available_strategies()


# -- data sharding follows the dp axis only ------------------------------------------------------------------


def test_distributed_sampler_shards_over_dp_only(tmp_path):
    trainer = make_trainer("tp2", 4, tmp_path)
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    trainer = make_trainer("dp", 4, tmp_path)
    assert trainer.strategy.distributed_sampler_kwargs["num_replicas"] == 4


# -- stratpack plan ------------------------------------------------------------------------------------------


def test_cli_plan(capsys):
    assert cli_main(["plan", "zero3_tp2_pp2", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "canonical: zero3_tp2_pp2" in out
    assert "resolved at world size 8: zero3_dp2_tp2_pp2_mb2" in out
    assert "pp=2 dp=2 cp=1 tp=2" in out
    assert "rank 1: {'pp': 0, 'dp': 0, 'cp': 0, 'tp': 1}" in out
    assert "rank 7: {'pp': 1, 'dp': 1, 'cp': 0, 'tp': 1}" in out


def test_cli_plan_pure_dp(capsys):
    assert cli_main(["plan", "dp", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "resolved at world size 2: dp2" in out
    assert "pp=1 dp=2 cp=1 tp=1" in out


def test_cli_impossible_plan(capsys):
    assert cli_main(["plan", "zero3_tp3", "--world-size", "8"]) == 2
    captured = capsys.readouterr()
    assert "tp(3) * pp(1) = 3 does not divide world_size 8" in captured.err
    assert captured.out == ""


def test_cli_bad_token(capsys):
    assert cli_main(["plan", "zero4"]) == 2
    assert "unknown token 'zero4'" in capsys.readouterr().err
