"""MaxText 0.2.5 runs a weights-only export of Llama 4: our `export --to maxtext` of the
transformers-written case `hf524_llama4` (4 layers: dense 0, 2 and MoE 1, 3; NoPE 1, 3 with
temperature tuning; chunked attention of 5 on the RoPE layers; L2 q/k norm; llama3 RoPE) in
MaxText's `llama4` decoder block (model `llama4-17b-16e` resized by the export's
`maxtext_overrides.json`). A part of `maxtext.py` (loaded by `_maxtext_weights_only.py`, `gen` set
to the maxtext generator: `maxtext_setup`, `flat_params`, `nested`, `tools`, `SOURCES`; `steps`
to `_maxtext_restore.py`).

    python tests/real/make.py maxtext -- --case maxtext_llama4

Steps: the export, scanned (MaxText scans Llama 4 in blocks of `inhomogeneous_layer_cycle_interval`
layers: `decoder.layers.layers_<p>`) and `--no-scan-layers`; MaxText's `setup_training_state` with
`load_parameters_path` restores each (its params equal to ours bit for bit, the unscanned ones per
layer); its forward (fp32, dot_product, the dense-matmul MoE path and the default sparse one)
against transformers' Llama4ForCausalLM of the same weights with the constants MaxText
hard-codes (RoPE original context 8192, temperature scale 0.1 and floor 8192); MaxText's
`save_checkpoint` of the restored params, as its converters save weights, is the case's `ckpt/`.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

import numpy as np

gen = None  # the maxtext generator module (set by _maxtext_weights_only)
steps = None  # _maxtext_restore.py, the weights cases' shared steps (set likewise)

SOURCE_CASE = "hf524_llama4"
MODEL_NAME = "llama4-17b-16e"
HOST_LLAMA4 = r"""
import json, sys, numpy as np, torch, transformers
ckpt, out = sys.argv[1], sys.argv[2]
tokens = torch.from_numpy(np.load(sys.argv[3]).astype(np.int64))
cfg = json.load(open(ckpt + "/config.json"))
variants = {
    "source": {},
    # what MaxText's llama4 block hard-codes: llama3.1 RoPE constants, temperature scale and floor
    "maxtext": {"rope_parameters": dict(cfg["rope_parameters"], original_max_position_embeddings=8192),
                "attn_scale": 0.1, "floor_scale": 8192},
}
res = {}
for name, change in variants.items():
    c = transformers.Llama4TextConfig(**{**cfg, **change})
    model = transformers.Llama4ForCausalLM.from_pretrained(ckpt, config=c, dtype=torch.float32,
                                                         attn_implementation="eager").eval()
    with torch.no_grad():
        res[name] = model(tokens).logits.float().numpy()
np.savez(out, **res)
"""


def generate(CASE: str, out: str, host_python: str) -> None:  # noqa: N803
    if CASE == "maxtext_llama4_adamw":
        return generate_adamw(CASE, out, host_python)
    from safetensors.numpy import load_file

    source = gen.SOURCES / SOURCE_CASE
    ref = load_file(str(source / "reference.safetensors"))
    work, ours, ours_unscanned, overrides = steps.export_both(source, host_python)
    tokens_path, logits_path = os.path.join(work, "tokens.npy"), os.path.join(work, "hf_logits.npz")
    np.save(tokens_path, ref["tokens"])
    subprocess.run([host_python, "-c", HOST_LLAMA4, str(source / "ckpt"), logits_path, tokens_path], check=True)
    hf = dict(np.load(logits_path))
    assert np.allclose(hf["source"], ref["logits"], rtol=0, atol=1e-5), steps.rel(hf["source"], ref["logits"])
    tokens = ref["tokens"].astype(np.int32)

    def run(path: str, extra: list[str]):
        config, _, params, logits = steps.restore_run(MODEL_NAME, "llama4", path, tokens, extra)
        return config, params, logits

    config, params, logits = run(ours, ["sparse_matmul=False"])
    rel = steps.rel(logits, hf["maxtext"])
    rel_source = steps.rel(logits, hf["source"])
    assert rel < 1e-5, rel
    assert rel_source > 1e-3, rel_source  # the hard-coded constants matter on this case
    steps.assert_same(steps.stored_params(ours), params, cast=False)

    _, params_unscanned, logits_unscanned = run(ours_unscanned, ["scan_layers=False", "sparse_matmul=False"])
    assert any(k.startswith("decoder.layers_3.") for k in params_unscanned), sorted(params_unscanned)[:5]
    steps.assert_same(steps.stored_params(ours_unscanned), params_unscanned, cast=False)
    assert np.allclose(logits_unscanned, logits, rtol=0, atol=1e-5 * np.max(np.abs(logits)))

    # MaxText's default MoE path (sparse_matmul, megablox's grouped matmul interpreted on CPU)
    _, _, logits_sparse = run(ours, ["sparse_matmul=True", "megablox=True"])
    rel_sparse = steps.rel(logits_sparse, hf["maxtext"])
    assert rel_sparse < 1e-5, rel_sparse

    case = steps.save_weights(out, CASE, params, config)
    gen.tools.write_reference(case, {"tokens": ref["tokens"], "logits_hf_maxtext": hf["maxtext"],
                                     "logits_hf_source": hf["source"], "logits_maxtext": logits,
                                     "logits_maxtext_unscanned": logits_unscanned,
                                     "logits_maxtext_sparse": logits_sparse})
    gen.tools.record_manifest(
        case, tool="maxtext",
        dists=steps.DISTS_HF,
        command=f"python tests/real/make.py maxtext -- --case {CASE}",
        overrides=overrides,
        references={
            "logits_hf_maxtext": f"transformers Llama4ForCausalLM (eager, fp32) of {SOURCE_CASE}'s checkpoint with the "
                                 "constants MaxText's llama4 block hard-codes: rope_parameters original_max_position_"
                                 "embeddings 8192, attn_scale 0.1, floor_scale 8192",
            "logits_hf_source": f"the same with {SOURCE_CASE}'s own config (its recorded logits, to 1e-5)",
            "logits_maxtext": "MaxText's forward (decoder_block llama4, fp32, dot_product, sparse_matmul=False) of our "
                              "scanned export restored by load_parameters_path",
            "logits_maxtext_unscanned": "the same of our --no-scan-layers export with scan_layers=False",
            "logits_maxtext_sparse": "the scanned export on MaxText's default MoE path (sparse_matmul, megablox)",
            "tokens": f"{SOURCE_CASE}'s tokens",
            "ckpt/": "MaxText's save_checkpoint of the params it restored from our scanned export, as its converters "
                     "save weights (TrainState step 0, opt_state {})",
        },
        notes=[
            f"our `export --to maxtext` of {SOURCE_CASE} (transformers 5.24's save_pretrained, fp32) restored by "
            f"MaxText's load_parameters_path into its llama4 decoder block (model {MODEL_NAME} resized by the "
            "export's maxtext_overrides.json), scanned in blocks of inhomogeneous_layer_cycle_interval "
            f"{overrides['overrides']['inhomogeneous_layer_cycle_interval']} layers, and unscanned: params bit for bit ours",
            f"forward vs HF logits with MaxText's constants: max rel {rel:.2e} (dense-matmul MoE), {rel_sparse:.2e} "
            f"(sparse/megablox); vs the source model's own config: {rel_source:.2e} (MaxText hard-codes the Llama 3.1 "
            "RoPE scaling constants and the temperature tuning's scale 0.1 / floor 8192; the export's notes say so)",
            "no MaxText converter output as reference: to_maxtext has no llama4 mapping (param_mapping.py "
            "PARAM_MAPPING), and standalone_scripts/llama4_ckpt_unscanned.py imports torch, which has no wheel "
            "for this Python 3.12 venv here",
        ],
    )
    print(json.dumps({"case": CASE, "rel": rel, "rel_sparse": rel_sparse, "rel_source": rel_source}))


# -- with the optimizer: a Llama 4 trained by torch (FSDP2, AdamW), MaxText restores and steps it ---


def to_maxtext(hf: dict[str, np.ndarray], cycle: int, n: int, heads: int, kv: int, hd: int) -> dict[str, np.ndarray]:
    """HF Llama 4 tensors -> MaxText's scanned llama4 tree, by hand (as its converters' hooks:
    kernels transposed and split by heads, the fused experts split into wi_0 / wi_1), layers
    b * cycle + p stacked on axis 1 of `decoder.layers.layers_<p>`."""
    per: dict[str, dict[int, np.ndarray]] = {}
    out = {"token_embedder.embedding": hf["model.embed_tokens.weight"], "decoder.decoder_norm.scale": hf["model.norm.weight"],
           "decoder.logits_dense.kernel": hf["lm_head.weight"].T}
    for layer in range(n):
        pre = f"model.layers.{layer}."
        got = {"self_attention.query.kernel": hf[pre + "self_attn.q_proj.weight"].T.reshape(-1, heads, hd),
               "self_attention.key.kernel": hf[pre + "self_attn.k_proj.weight"].T.reshape(-1, kv, hd),
               "self_attention.value.kernel": hf[pre + "self_attn.v_proj.weight"].T.reshape(-1, kv, hd),
               "self_attention.out.kernel": hf[pre + "self_attn.o_proj.weight"].T.reshape(heads, hd, -1),
               "pre_self_attention_layer_norm.scale": hf[pre + "input_layernorm.weight"],
               "post_self_attention_layer_norm.scale": hf[pre + "post_attention_layernorm.weight"]}
        ff = pre + "feed_forward."
        if ff + "router.weight" in hf:
            gate_up = hf[ff + "experts.gate_up_proj"]
            m = gate_up.shape[-1] // 2
            moe = "Llama4MoEBlock_0."
            got |= {moe + "MoeBlock_0.gate.kernel": hf[ff + "router.weight"].T,
                    moe + "MoeBlock_0.wi_0": gate_up[..., :m], moe + "MoeBlock_0.wi_1": gate_up[..., m:],
                    moe + "MoeBlock_0.wo": hf[ff + "experts.down_proj"]}
            got |= {f"{moe}shared_experts.{mt}.kernel": hf[f"{ff}shared_expert.{proj}.weight"].T
                    for mt, proj in (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))}
        else:
            got |= {f"mlp.{mt}.kernel": hf[f"{ff}{proj}.weight"].T
                    for mt, proj in (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))}
        for k, v in got.items():
            per.setdefault(f"decoder.layers.layers_{layer % cycle}.{k}", {})[layer // cycle] = v
    for k, blocks in per.items():
        out[k] = np.stack([blocks[b] for b in range(len(blocks))], axis=1)
    return out


def generate_adamw(CASE: str, out: str, host_python: str) -> None:  # noqa: N803
    """torch (transformers' Llama4ForCausalLM of hf524_llama4's config, FSDP2 over 2 gloo ranks,
    AdamW, 3 steps: tests/fixtures/dcp_writer.py) -> `export --to maxtext --optimizer` -> MaxText's
    `load_full_state_path` (params and moments bit for bit torch's, mapped by hand) -> MaxText's
    adamw one step with torch's next-step gradients = torch's step 4 -> MaxText's save: `ckpt/`."""
    import jax
    import optax
    from maxtext.common import checkpointing, train_state_nnx
    from maxtext.optimizers import optimizers

    work = tempfile.mkdtemp(prefix="mx-gen-")
    cfg_dir = os.path.join(work, "config")
    os.makedirs(cfg_dir)
    hf_cfg = json.load(open(gen.SOURCES / SOURCE_CASE / "ckpt" / "config.json"))
    json.dump(hf_cfg, open(os.path.join(cfg_dir, "config.json"), "w"))
    repo = gen.SOURCES.parents[2]
    env = dict(os.environ, PYTHONPATH=f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    subprocess.run([host_python, str(repo / "tests" / "fixtures" / "dcp_writer.py"), os.path.join(work, "dcp"), cfg_dir],
                   check=True, env=env)
    torch_ref = dict(np.load(os.path.join(work, "dcp", "fsdp2_ref.npz")))
    info = json.load(open(os.path.join(work, "dcp", "fsdp2_ref.json")))
    step, hyper = int(info["step"]), info["hyper"]
    ours = os.path.join(work, "ours")
    subprocess.run([host_python, "-m", "hybridckpt.cli", "export", os.path.join(work, "dcp", "fsdp2"), ours, "--to",
                    "maxtext", "--optimizer"], check=True, env=env)
    overrides = json.load(open(os.path.join(ours, "maxtext_overrides.json")))
    o = overrides["overrides"]
    dims = (o["inhomogeneous_layer_cycle_interval"], o["base_num_decoder_layers"], o["base_num_query_heads"],
            o["base_num_kv_heads"], o["head_dim"])

    def mapped(kind):
        return to_maxtext({k[len(kind) + 1:]: v for k, v in torch_ref.items() if k.startswith(kind + "/")}, *dims)

    extra = [f"adam_b1={hyper['betas'][0]}", f"adam_b2={hyper['betas'][1]}", f"adam_eps={hyper['eps']}",
             f"adam_weight_decay={hyper['weight_decay']}", "sparse_matmul=False"]
    config, module, state = gen.maxtext_setup(None, MODEL_NAME, steps.overrides(ours, [f"load_full_state_path={ours}/{step}/items",
                                                                                 *extra]))
    restored = train_state_nnx.to_checkpoint_dict(state)
    params = gen.flat_params(restored["params"]["params"])
    want = {"params": mapped("param"), "mu": mapped("exp_avg"), "nu": mapped("exp_avg_sq")}
    assert sorted(params) == sorted(want["params"]), sorted(set(params) ^ set(want["params"]))
    for k, v in want["params"].items():
        assert np.array_equal(params[k], v), k
    for slot in ("mu", "nu"):
        got = gen.flat_params(restored["opt_state"][0][slot]["params"])
        for k, v in want[slot].items():
            assert np.array_equal(got[k], v), (slot, k)
    assert int(restored["step"]) == step and int(restored["opt_state"][0]["count"]) == step

    lr = hyper["lr"]
    tx = optimizers.get_optimizer(config, lambda count: lr)
    p = {"params": gen.nested(params)}
    grads = {"params": gen.nested(mapped("grad"))}
    init = tx.init(p)
    opt = restored["opt_state"]

    def as_optax(count):
        adam = init[0]._replace(count=jax.numpy.asarray(count, jax.numpy.int32),
                                mu=gen.nested(gen.flat_params(opt[0]["mu"])), nu=gen.nested(gen.flat_params(opt[0]["nu"])))
        return (adam, *init[1:])

    def stepped(count):
        updates, _ = tx.update(grads, as_optax(count), p)
        return gen.flat_params(optax.apply_updates(p, updates)["params"])

    new, control = stepped(step), stepped(0)
    ref_next = mapped("next")
    errs = {k: steps.rel(new[k], v) for k, v in ref_next.items()}
    control_errs = {k: steps.rel(control[k], v) for k, v in ref_next.items()}
    assert max(errs.values()) < 1e-5, errs
    assert max(control_errs.values()) > 1e-3, control_errs

    _, new_opt = tx.update(grads, as_optax(step), p)
    count = jax.numpy.asarray(step + 1, jax.numpy.int32)
    saved = {"params": {"params": gen.nested(new)}, "step": count,
             "opt_state": [{"count": new_opt[0].count, "mu": new_opt[0].mu, "nu": new_opt[0].nu}, None, {"count": count}]}
    case = gen.tools.fresh_case(out, CASE)
    mngr = checkpointing.create_orbax_checkpoint_manager(os.path.join(case, "ckpt"), True, False, 1,
                                                         use_ocdbt=False, use_zarr3=False)
    checkpointing.save_checkpoint(mngr, step + 1, saved, config=config, force=True)
    checkpointing.wait_until_finished(mngr)
    gen.tools.write_reference(case, {f"next/{k[5:]}": v for k, v in torch_ref.items() if k.startswith("next/")})
    gen.tools.record_manifest(
        case, tool="maxtext",
        dists=steps.DISTS,
        command=f"python tests/real/make.py maxtext -- --case {CASE}",
        overrides=overrides, hf_config=hf_cfg, train={**hyper, "step_saved": step + 1},
        references={
            "next/<hf name>": f"torch's params after AdamW step {step + 1} (transformers Llama4ForCausalLM of "
                              f"{SOURCE_CASE}'s config, FSDP2 over 2 gloo ranks, tests/fixtures/dcp_writer.py)",
            "ckpt/": f"MaxText's save_checkpoint of the train state after its adamw's step {step + 1} from our "
                     "export's opt_state with torch's next-step gradients",
        },
        notes=[
            f"torch wrote a DCP checkpoint (FSDP2, AdamW {hyper}, step {step}); our `export --to maxtext --optimizer` "
            "of it restored by MaxText's load_full_state_path into its llama4 block (scanned in blocks of "
            f"{dims[0]} layers): params and Adam's mu / nu bit for bit torch's (mapped by hand), counts {step}",
            f"MaxText's adamw (optimizers.get_optimizer, constant lr {lr}) one step from the restored opt_state with "
            f"torch's next-step gradients: torch's step {step + 1} within max rel {max(errs.values()):.2e} on every "
            f"tensor (router, experts and shared expert included); from count 0 (negative control): "
            f"{max(control_errs.values()):.2e}",
        ],
    )
    print(json.dumps({"case": CASE, "max_err": max(errs.values()), "control": max(control_errs.values())}))
