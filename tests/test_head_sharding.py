"""Head-aligned sharding (issue 37, item 3): a dimension made of heads (q heads, kv heads, MLA's
per-head blocks, a fused qkv) or of experts splits over its mesh axes only between heads or
experts, never inside one; otherwise it is replicated on that axis with one note naming the real
count, or refused under `--strict-sharding`. Before, the plan divided `heads * head_dim`: 6 q / 2 kv
heads of 8 values on tp=4 cut each kv head in two, silently, and the tp=3 note said "kv_heads 16".

The configs are transformers' own (`XConfig(...).to_dict()`, read by `models.config_from_hf`);
the specs are checked on meshes without devices (`abstract_mesh`); the CLI's tp=4 runs in this
process where 4 devices are present, else in a subprocess (8 simulated devices of its own); the
import and restore in process on a fitted mesh.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import transformers
from jax.sharding import PartitionSpec as P
from meshes import abstract_mesh, fit

from hybridckpt import models, plan
from hybridckpt.errors import ConfigError, MeshError
from hybridckpt.naming import flatten

CLI = [sys.executable, "-m", "hybridckpt.cli"]
STRICT = "(--strict-sharding makes this an error)"
# 6 q heads and 2 kv heads of 8 values: q 48 and kv 16 values, which tp=4 divides, 3 does not
ATTN = dict(vocab_size=60, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, head_dim=8)  # fmt: skip
MOE = dict(ATTN, num_attention_heads=4, num_key_value_heads=2)


def hf_config(config_cls: str, **kwargs):
    """Our config of transformers' `config_cls(**kwargs)`, through its config.json dict."""
    return models.config_from_hf(getattr(transformers, config_cls)(**kwargs).to_dict())


def specs(cfg, mesh: str, **kw) -> tuple[dict[str, P], tuple[str, ...]]:
    """({leaf: PartitionSpec}, notes) of `cfg`'s plan on `mesh` (shapes only)."""
    p = plan.for_model(cfg, abstract_mesh(mesh), axis_rules=kw.pop("axis_rules", ""), **kw)
    return {k: s.spec for k, s in flatten(p.param_shardings).items()}, p.notes


def split(on: bool, ndim: int, dim: int, axis: str = "tp") -> P:
    """P with `axis` at `dim` when `on`, else all None (`ndim` dims)."""
    return P(*(axis if on and d == dim else None for d in range(ndim)))


# -- the specs: q / k / v / o of the GQA families -------------------------------------------------

# tp -> (q heads 6 split?, kv heads 2 split?)
SPLITS = {2: (True, True), 3: (True, False), 4: (False, False)}


@pytest.mark.parametrize("config_cls", ["LlamaConfig", "Qwen3Config"])
@pytest.mark.parametrize("tp", sorted(SPLITS))
def test_q_k_v_o_split_between_heads_only(config_cls, tp):
    cfg = hf_config(config_cls, **ATTN)
    got, notes = specs(cfg, f"tp={tp}")
    q_on, kv_on = SPLITS[tp]
    assert got["layers.q.kernel"] == split(q_on, 3, 2)  # [L, E, heads * head_dim]
    assert got["layers.o.kernel"] == split(q_on, 3, 1)  # [L, heads * head_dim, E]
    assert got["layers.k.kernel"] == got["layers.v.kernel"] == split(kv_on, 3, 2)
    assert got["layers.gate.kernel"] == split(True, 3, 2)  # the MLP width 96 splits on any of them
    kv_note = [n for n in notes if n.startswith("kv_heads")]
    q_note = [n for n in notes if n.startswith("heads")]
    assert kv_note == ([] if kv_on else [f"kv_heads 2 do not divide over tp={tp}: layers.k.kernel, "
                                         f"layers.v.kernel replicated on tp {STRICT}"])
    assert q_note == ([] if q_on else [f"heads 6 do not divide over tp={tp}: layers.o.kernel, "
                                       f"layers.q.kernel replicated on tp {STRICT}"])


def test_the_tp3_note_names_the_real_kv_head_count_once():
    _, notes = specs(hf_config("LlamaConfig", **ATTN), "tp=3")
    assert notes[0] == f"kv_heads 2 do not divide over tp=3: layers.k.kernel, layers.v.kernel replicated on tp {STRICT}"
    # the vocabulary (60 over 3 divides) and the head width are no subject of a note
    assert len(notes) == 1 and "16" not in notes[0]


def test_fused_qkv_and_gpt2_heads_split_between_heads_only():
    phi3 = hf_config("Phi3Config", **{k: v for k, v in ATTN.items() if k != "head_dim"},
                     pad_token_id=0, max_position_embeddings=64)  # head_dim 48 / 6 = 8; qkv 6 + 2 + 2 heads
    for tp, on in ((2, True), (4, False), (5, True)):  # 10 heads; 80 values split on tp=4 before
        got, notes = specs(phi3, f"tp={tp}")
        assert got["layers.qkv.kernel"] == split(on, 3, 2), tp
        assert on or f"qkv_heads 10 do not divide over tp={tp}: layers.qkv.kernel replicated on tp {STRICT}" in notes
    gpt2 = hf_config("GPT2Config", vocab_size=64, n_positions=16, n_embd=48, n_layer=2, n_head=6)
    got, notes = specs(gpt2, "tp=4")  # 6 heads of 8: 48 values
    assert got["layers.qkv.kernel"] == P(None, None, None, None) and got["layers.attn_out.kernel"] == P(None, None, None)
    assert got["layers.fc.kernel"] == P(None, None, "tp")  # n_inner 192 splits
    assert f"heads 6 do not divide over tp=4: layers.attn_out.kernel, layers.qkv.bias, layers.qkv.kernel replicated on tp {STRICT}" in notes
    got, _ = specs(gpt2, "fsdp=4")  # embed (48 values, not heads) splits over fsdp as before
    assert got["layers.qkv.kernel"] == P(None, "fsdp", None, None)


# -- MLA (DeepSeek V3): q_b, kv_b and o are per-head blocks; the latent dims never split ---------

MLA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
           num_attention_heads=6, num_key_value_heads=6, n_shared_experts=1, n_routed_experts=8,
           kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8, n_group=4,
           topk_group=2, num_experts_per_tok=2, max_position_embeddings=64, q_lora_rank=24,
           num_hidden_layers=2, first_k_dense_replace=1)  # fmt: skip


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_mla_heads_split_between_heads_only(tp):
    cfg = hf_config("DeepseekV3Config", **MLA)
    got, notes = specs(cfg, f"tp={tp}")
    on = 6 % tp == 0  # q_b 6 * 16 = 96, kv_b 6 * 20 = 120, o 6 * 12 = 72 values: tp=4 divides them all
    assert got["layers.q_b.kernel"] == got["layers.kv_b.kernel"] == split(on, 3, 2)
    assert got["layers.o.kernel"] == split(on, 3, 1)
    assert got["layers.kv_a.kernel"] == got["layers.q_a.kernel"] == P(None, None, None)  # latents whole
    leaves = ", ".join(f"{group}.{leaf}.kernel" for group in ("layers", "mtp.layers") for leaf in ("kv_b", "o", "q_b"))
    heads = [n for n in notes if n.startswith("heads")]  # the MTP module's attention too
    assert heads == ([] if on else [f"heads 6 do not divide over tp={tp}: {leaves} replicated on tp {STRICT}"])


# -- experts: the experts axis (dp by default, or as the axis rules say) -------------------------


@pytest.mark.parametrize("config_cls, experts", [("MixtralConfig", "num_local_experts"), ("Qwen3MoeConfig", "num_experts")])
def test_experts_split_between_experts_and_the_note_counts_them(config_cls, experts):
    extra = {"moe_intermediate_size": 16} if config_cls == "Qwen3MoeConfig" else {}
    cfg = hf_config(config_cls, **MOE, **{experts: 6}, num_experts_per_tok=2, **extra)
    leaves = ("moe.experts.down.kernel", "moe.experts.gate.kernel", "moe.experts.up.kernel")
    for mesh, rules, on, axis in (("dp=3", "", True, "dp"), ("dp=4", "", False, "dp"),
                                  ("tp=2", "experts=tp", True, "tp"), ("tp=4", "experts=tp", False, "tp")):
        got, notes = specs(cfg, mesh, axis_rules=rules)
        for leaf in leaves:  # [Lm, experts, ...]
            assert got[leaf][1] == (axis if on else None), (mesh, leaf, got[leaf])
        note = f"experts 6 do not divide over {mesh}: {', '.join(leaves)} replicated on {axis} {STRICT}"
        assert (note in notes) != on, (mesh, notes)


def test_gpt_oss_sinks_by_head_and_gate_up_by_pair():
    cfg = hf_config("GptOssConfig", **{**ATTN, "intermediate_size": 6}, num_local_experts=4, num_experts_per_tok=2)
    for tp, on in ((2, True), (3, True), (4, False)):  # 6 heads, 6 gate/up pairs (12 columns: tp=4 cut pairs)
        got, notes = specs(cfg, f"tp={tp}")
        assert got["layers.sinks"] == split(on, 2, 1), tp  # [L, heads]
        assert got["moe.experts.gate_up.kernel"] == split(on, 4, 3), tp  # [Lm, X, E, 2 * MX] interleaved
        assert got["moe.experts.down.kernel"] == split(on, 4, 2), tp  # [Lm, X, MX, E]: row j with pair j
        assert on or (f"gate_up pairs 6 do not divide over tp=4: moe.experts.gate_up.bias, moe.experts.gate_up.kernel "
                      f"replicated on tp {STRICT}") in notes


# -- refusals ---------------------------------------------------------------------------------------


def test_strict_sharding_names_the_heads():
    cfg = hf_config("LlamaConfig", **ATTN)
    with pytest.raises(MeshError, match=r"^layers\.k\.kernel: kv_heads 2 do not divide over tp=4 \(dim 2 of "
                       r"shape \(2, 48, 16\): 2 kv_heads of 8\); choose another mesh or drop strict_sharding=True"):
        plan.for_model(cfg, abstract_mesh("tp=4"), indivisible="error", axis_rules="")
    plan.for_model(cfg, abstract_mesh("tp=2"), indivisible="error", axis_rules="")  # 6 and 2 over 2: fine


def test_a_table_must_say_what_its_head_dims_are_made_of():
    from hybridckpt.models.table import Groups, Param, ParamTable

    rows = (Param("q.kernel", ("E", "Q"), ("embed", "heads"), "q.weight"),)
    dims = lambda cfg: {"E": 8, "Q": 12}  # noqa: E731
    with pytest.raises(ConfigError, match="dimension 'Q' on axis 'heads' is made of heads but the table's groups"):
        ParamTable(__name__, dims, rows).specs(None, {})
    with pytest.raises(ConfigError, match="dimension 'Q' of size 12 is 5 heads; expected a positive count"):
        ParamTable(__name__, dims, rows, lambda cfg: {"Q": Groups("heads", 5)}).specs(None, {})
    spec = ParamTable(__name__, dims, rows, lambda cfg: {"Q": Groups("heads", 3)}).specs(None, {})["q.kernel"]
    assert spec.groups == (None, Groups("heads", 3))


# -- end to end: the CLI, an import and a restore --------------------------------------------------


def save_llama(path, *, heads: int = 6, kv_heads: int = 2, seed: int = 0) -> torch.nn.Module:
    """A random LlamaForCausalLM of `ATTN`'s sizes saved by transformers (fp32 safetensors)."""
    cfg = transformers.LlamaConfig(**{**ATTN, "num_attention_heads": heads, "num_key_value_heads": kv_heads},
                                   attn_implementation="eager")
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.15 if p.ndim > 1 else 0.3)
    m.save_pretrained(path, safe_serialization=True)
    return m


@dataclass(frozen=True)
class Ran:
    returncode: int
    stdout: str
    stderr: str


def run(capsys, *args: str) -> Ran:
    """The CLI on `args` (a tp=4 mesh): its `main` in this process when 4 devices are present (no
    fresh interpreter, ~2 CPU-s), else a child, where the CLI simulates its 8 devices."""
    import jax

    if jax.device_count() >= 4:
        from hybridckpt.cli import main
        from hybridckpt.io.byte_source import close_all

        capsys.readouterr()
        try:
            code = main([str(a) for a in args])
        finally:
            close_all()
        out = capsys.readouterr()
        return Ran(code, out.out, out.err)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the CLI simulates its 8 devices
    r = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=600, env=env)
    return Ran(r.returncode, r.stdout, r.stderr)


def test_cli_refuses_tp4_over_2_kv_heads_under_strict_sharding_and_notes_it_otherwise(tmp_path, capsys):
    save_llama(tmp_path / "src")
    r = run(capsys, "import", tmp_path / "src", tmp_path / "ck", "--mesh", "tp=4", "--strict-sharding", "--quiet")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("hybridckpt: error: layers.k.kernel: kv_heads 2 do not divide over tp=4"), r.stderr
    assert "drop --strict-sharding" in r.stderr
    assert not (tmp_path / "ck").exists() and sorted(os.listdir(tmp_path)) == ["src"]
    lines = (f"kv_heads 2 do not divide over tp=4: layers.k.kernel, layers.v.kernel replicated on tp {STRICT}",
             f"heads 6 do not divide over tp=4: layers.o.kernel, layers.q.kernel replicated on tp {STRICT}")
    planned = run(capsys, "import", tmp_path / "src", tmp_path / "ck", "--mesh", "tp=4", "--plan")  # writes nothing
    r = run(capsys, "import", tmp_path / "src", tmp_path / "ck", "--mesh", "tp=4", "--quiet")
    for out in (planned, r):
        assert out.returncode == 0, out.stderr
        for line in lines:
            assert out.stdout.count(f"note: {line}\n") == 1, out.stdout


TOKENS = np.array([[1, 5, 9, 3, 7, 2, 8, 4], [0, 11, 42, 17, 6, 5, 50, 3]], dtype=np.int32)


def test_a_replicated_kv_dim_keeps_every_value_and_the_logits(tmp_path):
    import hybridckpt
    from hybridckpt.jobs.logits import logits

    m = save_llama(tmp_path / "src", heads=6, kv_heads=3)  # kv 3 * 8 = 24 values: tp=2 cut a head
    mesh = fit("tp=2")
    tp = mesh == "tp=2"  # one device: nothing splits
    summary = hybridckpt.import_checkpoint(tmp_path / "src", tmp_path / "ck", mesh=mesh)
    note = f"kv_heads 3 do not divide over tp=2: layers.k.kernel, layers.v.kernel replicated on tp {STRICT}"
    assert (note in summary.notes) == tp, summary.notes
    # restore onto the same mesh, and a dp=1 import restored onto it: the plan is made the same way
    hybridckpt.import_checkpoint(tmp_path / "src", tmp_path / "ck1", mesh="dp=1")
    sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    for ck in ("ck", "ck1"):
        _, restored = hybridckpt.restore(str(tmp_path / ck), mesh, optimizer=False)
        assert (note in restored.notes) == tp, restored.notes
        layers = restored.params["layers"]
        assert layers["k"]["kernel"].sharding.spec == layers["v"]["kernel"].sharding.spec == P(None, None, None)
        assert layers["q"]["kernel"].sharding.spec == P(None, None, "tp" if tp else None)  # 6 heads over 2
        for name in ("q", "k", "v", "o"):
            got = np.asarray(layers[name]["kernel"])
            want = np.stack([sd[f"model.layers.{i}.self_attn.{name}_proj.weight"].T for i in range(2)])
            assert got.dtype == want.dtype and np.array_equal(got.view(np.uint32), want.view(np.uint32)), name
    if tp:
        with pytest.raises(MeshError, match="layers.k.kernel: kv_heads 3 do not divide over tp=2"):
            hybridckpt.restore(str(tmp_path / "ck1"), mesh, optimizer=False, strict_sharding=True)
    with torch.no_grad():
        want = m(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    got = logits(str(tmp_path / "ck"), TOKENS, mesh=mesh)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)  # fp32 against transformers' fp32 forward
