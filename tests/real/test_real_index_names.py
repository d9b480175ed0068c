"""Index-keyed optimizer states imported WITH their moments (issue 40): the Trainer's
`optimizer.pt` and accelerate's `optimizer.bin` as the tools wrote them
(`generators/index_optim.py`), and a plain loop's `torch.save({"model", "optimizer"})` written here
by torch.

No file records which parameter index i is: hybridckpt names it from the model's
`named_parameters()` order and the tool's grouping (`optim.index_names`). Proven against the
tool's own run: imported on mesh A, restored on mesh B and exported, params and moments bit for
bit the runtime's after step 3; one optax AdamW step (rebuilt from the recorded hyper-parameters,
the Trainer's no-decay group as a mask) with the gradient the tool's 4th step consumed lands on
the tool's params after it. Shapes cannot place `q_proj` against `o_proj` (both [8, 8]): a
--param-order swapping them passes every shape and group check, and the step shows it wrong.
"""

from __future__ import annotations

import json
import os
import shutil

import cases
import numpy as np
import pytest
from e2e import optax_init, optax_step

from hybridckpt import jobs, optim
from hybridckpt.errors import ConfigError, FormatError

CASES = {"hf_trainer_index": "optimizer.pt", "accelerate_index": "optimizer.bin"}
Q_PROJ, O_PROJ = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"


def _refs(case: str, kind: str) -> dict[str, np.ndarray]:
    return {k[len(kind) + 1:]: v for k, v in cases.reference(case).items() if k.startswith(kind + "/")}


def _index_order(case: str) -> list[str]:
    """The truth no file records: the names in index order, as the generator took them from torch."""
    return [n for g in cases.manifest(case)["hyper"] for n in g["names"]]


@pytest.fixture(scope="module", params=sorted(CASES))
def imported(request, tmp_path_factory):
    from e2e import roundtrip

    case = request.param
    work = tmp_path_factory.mktemp(case)
    out = roundtrip(cases.ckpt(case, "checkpoint-3"), str(work), mesh_a="fsdp=2,tp=2", mesh_b="dp=2,fsdp=2",
                    keep=("fsdp",))
    return case, str(work), out


def test_params_and_moments_bitwise_through_a_mesh(imported):
    case, _, (params, mu, nu, step) = imported
    for got, kind in ((params, "param"), (mu, "exp_avg"), (nu, "exp_avg_sq")):
        want = _refs(case, kind)
        assert sorted(got) == sorted(want) and len(want) == 21, kind
        for k, w in want.items():
            assert np.array_equal(np.asarray(got[k]).view(np.uint32), w.view(np.uint32)), (kind, k)
    assert step == 3


def test_the_next_step_equals_the_tools_fourth(imported):
    from test_real_trainer import _step

    case, work, (params, _, _, _) = imported
    want, grads = _refs(case, "param_next"), _refs(case, "grad")
    got = _step(work, grads)
    for k, w in want.items():
        np.testing.assert_allclose(got[k], w, rtol=1e-5, atol=1e-7, err_msg=k)
        assert not np.allclose(w, params[k], rtol=1e-5, atol=1e-7), k  # every param moved
    wrong = _step(work, grads, count_delta=1)  # negative control: the count one off
    assert not all(np.allclose(wrong[k], want[k], rtol=1e-5, atol=1e-7) for k in want)


def test_inspect_says_what_it_decided_and_why():
    notes = jobs.inspect(cases.ckpt("hf_trainer_index"))["notes"]
    assert ("optimizer.pt keyed by index: named by the Trainer's grouping (16 decay / 5 no-decay, "
            "named_parameters() order of llama)") in notes
    notes = jobs.inspect(cases.ckpt("accelerate_index", "checkpoint-3"))["notes"]
    assert "optimizer.bin keyed by index: named by one group in the named_parameters() order of llama" in notes


def _optax_step(opened, grads: dict) -> dict[str, np.ndarray]:
    """One step of hybridckpt's optimizer mapping (`optim.for_slots(...).build`: optax.adamw from
    the recorded hyper-parameters, the groups with weight_decay 0 masked) over HF-named arrays."""
    import jax.numpy as jnp

    named, hyper = opened.named, opened.hyper
    params = {k: jnp.asarray(named.params[k].materialize()) for k in named.slots["exp_avg"]}  # (a tied copy: none)
    undecayed = {n for g in hyper.get("groups") or [] if g["weight_decay"] == 0 for n in g["params"]}
    tx = optim.for_slots(named.slots).build(hyper, {k: k not in undecayed for k in params})
    state = optax_init(tx, params)
    adam = state[0]._replace(count=jnp.asarray(named.step, jnp.int32),
                             mu={k: jnp.asarray(named.slots["exp_avg"][k].materialize()) for k in params},
                             nu={k: jnp.asarray(named.slots["exp_avg_sq"][k].materialize()) for k in params})
    after = optax_step(tx, {k: jnp.asarray(grads[k]) for k in params}, (adam, *state[1:]), params)
    return {k: np.asarray(v) for k, v in after.items()}


def _close(got: dict, want: dict) -> bool:
    return all(np.allclose(got[k], want[k], rtol=1e-5, atol=1e-7) for k in want)


def test_a_same_shape_swap_passes_the_checks_and_the_step_shows_it_wrong(tmp_path):
    """--param-order with the true index order steps like the tool; with q_proj and o_proj of
    layer 0 swapped (same shape, same group) every check passes, but the moments and the step do
    not: the default mapping is right by the tool's own step, not by its shapes."""
    case, src = "hf_trainer_index", cases.ckpt("hf_trainer_index", "checkpoint-3")
    want, grads = _refs(case, "param_next"), _refs(case, "grad")
    order = _index_order(case)
    right = tmp_path / "right.txt"
    right.write_text("\n".join(order) + "\n")
    assert _close(_optax_step(jobs.open_checkpoint(src, param_order=right), grads), want)
    assert _close(_optax_step(jobs.open_checkpoint(src), grads), want)  # the default: the Trainer's rule
    i, j = order.index(Q_PROJ), order.index(O_PROJ)
    order[i], order[j] = order[j], order[i]
    opened = jobs.open_checkpoint(src, param_order=order)  # accepted: shapes and groups all agree
    assert not np.array_equal(opened.named.slots["exp_avg"][Q_PROJ].materialize(), _refs(case, "exp_avg")[Q_PROJ])
    assert not _close(_optax_step(opened, grads), want)


def _hostile(tmp_path, case: str, edit) -> str:
    """A copy of the case's checkpoint whose optimizer state dict `edit` changed, saved by torch."""
    torch = pytest.importorskip("torch")
    folder = tmp_path / case
    shutil.copytree(cases.ckpt(case, "checkpoint-3"), folder)
    if case == "accelerate_index":
        shutil.copy(cases.ckpt(case, "config.json"), folder / "config.json")
    path = folder / CASES[case]
    sd = torch.load(path, weights_only=True)
    edit(sd)
    torch.save(sd, path)
    return str(folder)


def test_a_state_that_does_not_fit_is_refused_in_one_line(tmp_path):
    def decay_everywhere(sd):  # the Trainer's no-decay group with weight decay: not the Trainer's groups
        sd["param_groups"][1]["weight_decay"] = 0.1

    def one_group_more(sd):  # a third group taking the last parameter of group 1
        last = sd["param_groups"][1]["params"].pop()
        sd["param_groups"].append({**sd["param_groups"][1], "params": [last]})

    def moments_of_another_shape(sd):  # index 1 (q_proj, [8, 8]) holding a [4, 16] moment
        for slot in ("exp_avg", "exp_avg_sq"):
            sd["state"][1][slot] = sd["state"][1][slot].reshape(4, 16)

    for edit, words in ((decay_everywhere, "no-decay group (param group 1) has weight_decay 0.1, not 0"),
                        (one_group_more, "the Trainer builds 2 param groups (decay, no-decay); this state has 3"),
                        (moments_of_another_shape, f"state[1] exp_avg has shape (4, 16), but {Q_PROJ} (group 0) needs (8, 8)")):
        src = _hostile(tmp_path / edit.__name__, "hf_trainer_index", edit)
        with pytest.raises(FormatError) as e:
            jobs.open_checkpoint(src)
        msg = str(e.value)
        assert words in msg and "optimizer.pt" in msg and "--param-order" in msg and "\n" not in msg, msg


def test_a_bad_param_order_is_refused(tmp_path):
    src = cases.ckpt("hf_trainer_index", "checkpoint-3")
    order = _index_order("hf_trainer_index")
    for names, words in ((order[:-1], "20 names, but optimizer.pt holds 21 parameters in 2 param groups (16 / 5)"),
                         ([*order[:-1], order[0]], f"{order[0]!r} is listed twice"),
                         ([*order[:-1], "model.layers.9.mlp.up_proj.weight"], "names no parameter of the model has: ['model.layers.9.mlp.up_proj.weight']")):
        path = tmp_path / "order.txt"
        path.write_text("\n".join(names))
        with pytest.raises(ConfigError, match="--param-order .*order.txt: ") as e:
            jobs.open_checkpoint(src, param_order=path)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    fsdp = cases.ckpt("hf_trainer_fsdp2_full", "checkpoint-3")  # keyed by name: nothing to order
    with pytest.raises(ConfigError, match="holds no optimizer state keyed by parameter index"):
        jobs.open_checkpoint(fsdp, param_order=order)
    with pytest.raises(ConfigError, match="neither .* nor .* holds an optimizer state keyed by parameter index"):
        jobs.verify(fsdp, fsdp, param_order=order)
    rows, only_a, only_b = jobs.verify(src, src, param_order=order)  # (both sides named by it)
    assert not only_a and not only_b and all(r.ok for r in rows) and sum(r.kind == "slot" for r in rows) == 42


def test_cli_param_order_and_refusal(tmp_path, capsys):
    from hybridckpt.cli import main

    src = cases.ckpt("hf_trainer_index", "checkpoint-3")
    path = tmp_path / "order.txt"
    path.write_text("\n".join(_index_order("hf_trainer_index")))
    assert main(["inspect", src, "--param-order", str(path)]) == 0
    assert f"named by the order given (--param-order {path}), groups 16 / 5 in turn" in capsys.readouterr().out
    path.write_text("model.embed_tokens.weight\n")
    assert main(["inspect", src, "--param-order", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "1 names, but optimizer.pt holds 21 parameters" in err, err


def test_a_plain_torch_loop_file(tmp_path):
    """`torch.save({"model": sd, "optimizer": opt.state_dict(), "epoch": ...})` of a tied Llama (its
    head appears once in named_parameters()) with AdamW(model.parameters()): one group."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg).float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = torch.randint(0, 32, (2, 8))

    def step() -> dict[str, np.ndarray]:
        opt.zero_grad()
        model(tokens, labels=tokens).loss.backward()
        grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}
        opt.step()
        return grads

    for _ in range(3):
        step()
    folder = tmp_path / "run"
    folder.mkdir()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}, folder / "last.pt")
    cfg.save_pretrained(folder)
    mu = {n: opt.state[p]["exp_avg"].numpy().copy() for n, p in model.named_parameters()}
    grads = step()
    after = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    opened = jobs.open_checkpoint(str(folder))
    assert "last.pt ['optimizer'] keyed by index: named by one group in the named_parameters() order of llama" in opened.notes
    assert sorted(opened.named.slots["exp_avg"]) == sorted(mu) and "lm_head.weight" not in mu
    for n, m in mu.items():
        assert np.array_equal(opened.named.slots["exp_avg"][n].materialize(), m), n
    assert opened.step == 3 and _close(_optax_step(opened, grads), after)
    # two groups taken in turn: a loop's own grouping, the same names in named_parameters() order
    names = [n for n, _ in model.named_parameters()]
    sd = torch.load(folder / "last.pt", weights_only=True)
    g = sd["optimizer"]["param_groups"][0]
    sd["optimizer"]["param_groups"] = [{**g, "params": g["params"][:5]}, {**g, "params": g["params"][5:], "lr": 5e-3}]
    torch.save(sd, folder / "last.pt")
    opened = jobs.open_checkpoint(str(folder))
    assert "2 groups taking the named_parameters() order of llama in turn (5 / 15)" in " ".join(opened.notes)
    assert [len(x["params"]) for x in opened.hyper["groups"]] == [5, 15] and opened.hyper["groups"][0]["params"] == names[:5]
    (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                    "num_hidden_layers": 1}))
    with pytest.raises(Exception) as e:  # a config of another model: no mapping claimed
        jobs.open_checkpoint(str(folder))
    assert "\n" not in str(e.value)
    assert os.path.isfile(folder / "last.pt")


def _hub(fused: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """transformers 5 Mixtral's live (fused) names -> the Hub's per-expert files' names: expert e
    of `mlp.experts.gate_up_proj` [X, 2M, E] is `w1` (its first M rows) and `w3`, of `down_proj` `w2`."""
    out = {}
    for n, v in fused.items():
        pre, _, rest = n.partition(".mlp.")
        if rest == "gate.weight":
            out[f"{pre}.block_sparse_moe.gate.weight"] = v
        elif rest == "experts.gate_up_proj":
            m = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{pre}.block_sparse_moe.experts.{e}.w1.weight"] = v[e, :m]
                out[f"{pre}.block_sparse_moe.experts.{e}.w3.weight"] = v[e, m:]
        elif rest == "experts.down_proj":
            out.update({f"{pre}.block_sparse_moe.experts.{e}.w2.weight": v[e] for e in range(v.shape[0])})
        else:
            out[n] = v
    return out


def test_a_moe_models_fused_experts(tmp_path):
    """transformers 5 holds Mixtral's experts fused (`mlp.experts.gate_up_proj` [X, 2M, E]): the
    optimizer's indices name those, while `save_pretrained` writes the Hub's per-expert tensors.
    A Trainer-grouped AdamW (`Trainer.get_decay_parameter_names`) of 3 steps: each expert's
    moments are its slice of the fused moment, and one optax step equals torch's 4th; a loop's
    `torch.save` of the live state dict (fused names) is read the same."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=32, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2)  # fmt: skip
    model = transformers.MixtralForCausalLM(cfg).float()
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    opt = torch.optim.AdamW([{"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": 0.1},
                             {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95))  # fmt: skip
    tokens = torch.randint(0, 32, (2, 8))

    def step() -> dict[str, np.ndarray]:
        opt.zero_grad()
        model(tokens, labels=tokens).loss.backward()
        grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}
        opt.step()
        return grads

    for _ in range(3):
        step()
    trainer, loop = tmp_path / "checkpoint-3", tmp_path / "loop"
    model.save_pretrained(trainer)
    torch.save(opt.state_dict(), trainer / "optimizer.pt")
    (trainer / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    loop.mkdir()
    cfg.save_pretrained(loop)
    osd, names = opt.state_dict(), [n for n, _ in model.named_parameters()]
    torch.save({"model": model.state_dict(), "optimizer": osd}, loop / "model.pt")
    with pytest.raises(FormatError, match=r"model.pt \['optimizer'\]: .*2 groups taking the named_parameters\(\) order "
                       r"of mixtral in turn \(16 / 5\) does not fit: state\[8\] exp_avg has shape \(8, 8\), but "
                       r"model.layers.0.input_layernorm.weight \(group 0\) needs \(8,\); pass --param-order"):
        jobs.open_checkpoint(str(loop))  # a loop's file is not the Trainer's: its grouping is caught by a shape
    param_of = dict(model.named_parameters())
    index = [n for g in opt.param_groups for p in g["params"] for n in names if param_of[n] is p]  # names by index
    osd["state"] = {names.index(n): osd["state"][i] for i, n in enumerate(index)}  # one group, named_parameters() order
    osd["param_groups"] = [{**osd["param_groups"][0], "params": list(range(len(names)))}]
    torch.save({"model": model.state_dict(), "optimizer": osd}, loop / "model.pt")
    mu = _hub({n: opt.state[p]["exp_avg"].numpy().copy() for n, p in model.named_parameters()})
    grads = _hub(step())
    after = _hub({n: p.detach().numpy().copy() for n, p in model.named_parameters()})
    for folder, rule in ((trainer, "the Trainer's grouping (16 decay / 5 no-decay, named_parameters() order of mixtral)"),
                         (loop, "one group in the named_parameters() order of mixtral")):
        opened = jobs.open_checkpoint(str(folder))
        assert any(n.endswith(f"keyed by index: named by {rule}") for n in opened.notes), opened.notes
        got = opened.named.slots["exp_avg"]
        assert sorted(got) == sorted(mu) and "model.layers.1.block_sparse_moe.experts.3.w3.weight" in got
        for n, m in mu.items():
            assert np.array_equal(got[n].materialize(), m), (folder.name, n)
    assert _close(_optax_step(jobs.open_checkpoint(str(trainer)), grads), after)


_TINY = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=8)
FAMILIES_OF_TODAY = {  # family: (transformers model, its config, the config's kwargs beyond _TINY)
    "ernie4_5": ("Ernie4_5ForCausalLM", "Ernie4_5Config", dict(use_bias=True)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(_MOE, num_experts=4, shared_expert_intermediate_size=12,
                                                                   mlp_only_layers=[0])),
    "llama4": ("Llama4ForCausalLM", "Llama4TextConfig", dict(num_local_experts=2, num_experts_per_tok=1, head_dim=4,
                                                             interleave_moe_layer_step=2, intermediate_size_mlp=20)),
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig", dict(_MOE, n_routed_experts=4, first_k_dense_replace=1, n_group=1,
                                                             topk_group=1)),
    "ernie4_5_moe": ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", dict(_MOE, moe_num_experts=4, moe_k=2,
                                                                            moe_layer_start_index=1)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(_MOE, n_routed_experts=4, first_k_dense_replace=1,
                                                                      n_group=1, topk_group=1, kv_lora_rank=8,
                                                                      num_key_value_heads=4,
                                                                      q_lora_rank=None, qk_nope_head_dim=4,
                                                                      qk_rope_head_dim=4, v_head_dim=8)),
}  # fmt: skip
# a router bias transformers does not train (a buffer; ERNIE's a frozen parameter): refused
REFUSED = {"glm4_moe": "model.layers.1.mlp.gate.e_score_correction_bias",
           "ernie4_5_moe": "model.layers.1.mlp.moe_statics.e_score_correction_bias",
           "deepseek_v3": "model.layers.1.mlp.gate.e_score_correction_bias"}  # fmt: skip


def _trainer_checkpoint(folder, family: str):
    """A Trainer checkpoint of a tiny `family` model after 2 steps (its `create_optimizer`: the
    trainable params in two groups by `get_decay_parameter_names`): (model, its AdamW)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model_cls, config_cls, extra = FAMILIES_OF_TODAY[family]
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**_TINY, **extra})).float()
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
                             {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}], lr=1e-2)
    tokens = torch.randint(3, 32, (2, 6))
    for _ in range(2):
        opt.zero_grad()
        model(tokens, labels=tokens).loss.backward()
        opt.step()
    model.save_pretrained(folder)
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    return model, opt


def _per_expert(name: str, m: np.ndarray) -> dict[str, np.ndarray]:
    """A live moment under the Hub's names: a fused expert tensor's per expert."""
    pre, _, rest = name.rpartition(".experts.")
    if not pre:
        return {name: m}
    if rest == "gate_up_proj":
        half = m.shape[1] // 2
        return {f"{pre}.experts.{e}.{p}.weight": x for e in range(m.shape[0])
                for p, x in (("gate_proj", m[e, :half]), ("up_proj", m[e, half:]))}  # fmt: skip
    return {f"{pre}.experts.{e}.down_proj.weight": m[e] for e in range(m.shape[0])}


@pytest.mark.parametrize("family", sorted(FAMILIES_OF_TODAY))
def test_the_families_of_today_by_the_trainers_own_state(tmp_path, family):
    """The families added with their named_parameters() order (issue 41): a Trainer state of
    transformers' own tiny model is named right, every moment on its parameter (ERNIE's biases
    after each weight, its norms after the MLP; Qwen2-MoE's fused experts, shared expert and its
    gate; Llama 4's interleaved dense and MoE layers); where transformers does not train a router
    bias the table holds, the state is refused in one line, not guessed."""
    folder = tmp_path / "checkpoint-2"
    model, opt = _trainer_checkpoint(folder, family)
    if family in REFUSED:
        with pytest.raises(FormatError) as e:
            jobs.open_checkpoint(str(folder))
        msg = str(e.value)
        assert "\n" not in msg and "optimizer.pt" in msg and "--param-order" in msg, msg
        assert f"{family}'s named_parameters() order (models/{family}/params.py) does not place ['{REFUSED[family]}'" in msg
        return
    opened = jobs.open_checkpoint(str(folder))
    assert any("optimizer.pt keyed by index: named by the Trainer's grouping" in n and f"order of {family})" in n
               for n in opened.notes), opened.notes  # fmt: skip
    moments = {n: opt.state[p]["exp_avg"].numpy() for n, p in model.named_parameters()}
    if family != "llama4":  # (Llama 4's files hold the experts fused, as its module does)
        moments = {k: v for n, m in moments.items() for k, v in _per_expert(n, m).items()}
    want = moments
    got = opened.named.slots["exp_avg"]
    assert sorted(got) == sorted(want)
    for n, m in want.items():
        assert np.array_equal(got[n].materialize(), m), n
