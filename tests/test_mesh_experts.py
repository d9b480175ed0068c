"""The `experts` logical axis: split over `dp` by default (never replicated on a mesh with dp > 1),
and overridable through `$HYBRIDCKPT_AXIS_RULES` / `axis_rules`. The rules alone: meshes without
devices (`abstract_mesh`), the same specs on any device count."""

import pytest
from jax.sharding import PartitionSpec as P
from meshes import abstract_mesh

from hybridckpt.errors import MeshError
from hybridckpt.mesh import axis_rules, partition_spec

EXPERTS = ("layers", "experts", "embed", "mlp")


def spec(mesh, rules=None):
    return partition_spec("moe.experts.gate.kernel", (2, 4, 16, 8), EXPERTS, mesh, rules=axis_rules(rules))


def test_experts_split_over_dp_by_default(monkeypatch):
    monkeypatch.delenv("HYBRIDCKPT_AXIS_RULES", raising=False)
    assert spec(abstract_mesh("dp=2,fsdp=2,tp=2")) == P(None, "dp", "fsdp", "tp")
    assert spec(abstract_mesh("dp=4,pp=2")) == P("pp", "dp", None, None)
    assert spec(abstract_mesh("dp=1")) == P(None, None, None, None)


def test_axis_rules_override_by_env_and_argument(monkeypatch):
    mesh = abstract_mesh("dp=2,fsdp=2,tp=2")
    monkeypatch.setenv("HYBRIDCKPT_AXIS_RULES", "experts=fsdp")
    # experts take fsdp, so embed (also fsdp) stays whole on it
    assert spec(mesh) == P(None, "fsdp", None, "tp")
    assert spec(mesh, {"experts": ("dp", "fsdp")}) == P(None, ("dp", "fsdp"), None, "tp")
    assert spec(mesh, "experts=none") == P(None, None, "fsdp", "tp")
    with pytest.raises(MeshError, match="experts=ep"):
        axis_rules("experts=ep")


def test_plan_of_an_moe_model_splits_experts_and_moments(monkeypatch):
    """`plan.for_model` (what import, restore and logits use): experts and their AdamW moments on
    dp by default, on fsdp under `HYBRIDCKPT_AXIS_RULES=experts=fsdp`."""
    from hybridckpt import optim, plan
    from hybridckpt.models.mixtral.config import MixtralConfig

    cfg = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2,
                        num_heads=4, num_kv_heads=2, num_experts=4)  # fmt: skip
    mesh = abstract_mesh("dp=2,fsdp=2,tp=2")
    monkeypatch.delenv("HYBRIDCKPT_AXIS_RULES", raising=False)
    p = plan.for_model(cfg, mesh, optimizer=optim.get("adamw"))
    want = P(None, "dp", "fsdp", "tp")
    assert p.param_shardings["moe"]["experts"]["gate"]["kernel"].spec == want
    for slot in ("exp_avg", "exp_avg_sq"):
        assert p.slot_shardings(slot)["moe"]["experts"]["gate"]["kernel"].spec == want
    monkeypatch.setenv("HYBRIDCKPT_AXIS_RULES", "experts=fsdp")
    p = plan.for_model(cfg, mesh, optimizer=optim.get("adamw"))
    assert p.param_shardings["moe"]["experts"]["gate"]["kernel"].spec == P(None, "fsdp", None, "tp")
