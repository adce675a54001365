"""`selector.compose` keeps Hydra's compose of the presets chosen and applies the other
overrides to a copy, as Hydra applies them: the result, and every refusal, must be
exactly what Hydra's whole compose gives."""

import pytest
from omegaconf import OmegaConf

import selector
from selector.compose import _hydra_compose
from selector.findings import ConfigError

AGREE = [
    [],
    ["model=tiny", "mesh=cpu_8"],
    ["mesh=cpu_8", "model=tiny", "ici_context_parallelism=4"],
    ["model=qwen3_next_80b_a3b", "hardware=v5p", "hardware.memory_gib=90", "num_devices=64"],
    ["model=deepseek_v3", "hardware=h200", "per_device_batch_size=0.25", "mode=prefill"],
    ["model=tiny", "axis_rules.experts=[expert,context]", "dtype=float32"],
    ["model=tiny", "model=deepseek_v3"],  # a group chosen twice: the last wins
    ["~num_experts", "model=tiny"],  # a key deleted
    ["model=mixtral_8x7b", "max_target_length=${base_emb_dim}"],  # an interpolation
    ["num_experts=4", "num_experts=16"],  # the same key twice: the last wins
]

REFUSED = [
    ["num_experts=four"],
    ["model=tiny", "ici_contxt_parallelism=4"],
    ["model=no_such_model"],
    ["num_experts=4,8"],  # a sweep
    ["dispatch=fastest"],
    ["hardware.memory_gb=90"],
    ["~no_such_key"],
    ["num_experts@pkg=4"],
    ["num_experts=["],
    ["num_experts=" + "9" * 5000],  # past Python's digits limit: a ValueError in the parser
]


def _same(a, b) -> None:
    assert OmegaConf.to_yaml(a) == OmegaConf.to_yaml(b)
    assert OmegaConf.is_struct(a) and OmegaConf.is_struct(b)
    assert OmegaConf.get_type(a) is OmegaConf.get_type(b)
    assert selector.to_config(a) == selector.to_config(b)


@pytest.mark.parametrize("overrides", AGREE, ids=lambda o: " ".join(o) or "defaults")
def test_compose_is_hydras_compose(overrides):
    _same(selector.compose(overrides), _hydra_compose(tuple(overrides)))
    # Again, from the kept presets: what the first call's overrides did stays its own.
    _same(selector.compose(overrides), _hydra_compose(tuple(overrides)))
    groups = tuple(o for o in overrides if o.split("=")[0] in ("model", "mesh", "hardware"))
    _same(selector.compose(groups), _hydra_compose(groups))


@pytest.mark.parametrize("overrides", REFUSED, ids=lambda o: " ".join(o)[:40])
def test_compose_refuses_as_hydras_compose_does(overrides):
    with pytest.raises(ConfigError) as ours:
        selector.compose(overrides)
    with pytest.raises(ConfigError) as hydras:
        _hydra_compose(tuple(overrides))
    assert str(ours.value) == str(hydras.value)


@pytest.mark.parametrize("overrides", AGREE, ids=lambda o: " ".join(o) or "defaults")
def test_a_composed_config_converts_as_its_plain_settings_do(overrides):
    """`to_config` takes a composed DictConfig as it is (no merge onto the schema): the
    Config must be the one its settings give as a plain mapping, interpolations
    resolved, and a value set wrong after composing is still refused."""
    composed = selector.compose(overrides)
    plain = OmegaConf.to_container(composed, resolve=True)
    assert selector.to_config(composed) == selector.to_config(plain)
    with pytest.raises(Exception, match="num_experts"):
        composed.num_experts = "four"  # the schema refuses it as it is set
        selector.to_config(composed)
