"""MaxText 0.2.5 itself loads, runs and steps what `hybridckpt export --to maxtext --optimizer`
writes, and writes the checkpoint the suite reads back.

    python tests/real/make.py maxtext        (side venv: Python 3.12, maxtext 0.2.5, CPU JAX)

Input: the committed torchtitan cases `torchtitan_llama3`, `torchtitan_qwen3`, `torchtitan_qwen3_moe`
(DCP checkpoints with AdamW state at step 3, their reference params, moments, next-step gradients
and torchtitan's next step). Qwen3-MoE runs MaxText's qwen3_moe block (model qwen3-30b-a3b
resized) with the dense-matmul MoE path (`sparse_matmul=False`: every expert's einsum weighted by
the routing; the default megablox path is a Pallas kernel for TPU/GPU) and `capacity_factor=-1`:
dropless, so its forward is exact; its routing (top k of the logits, softmax over the k) is HF's
`norm_topk_prob: true`, which the case has.
Steps (MaxText's own code wherever MaxText has code for it):
1. `hybridckpt export ckpt OUT --to maxtext --optimizer` (and `--no-scan-layers`, params only),
   run with the repository's venv (`--host-python`); the host also computes the HF reference
   logits with transformers (below).
2. MaxText's converter `maxtext.checkpoint_conversion.to_maxtext` (model llama3.1-8b resized by
   overrides) on the reference params as an HF folder: its output is the reference layout and
   values (`converter/<maxtext path>`).
3. MaxText's `maxtext_utils.setup_training_state` with `load_full_state_path=OUT/3/items`
   (its `checkpointing.load_state_if_possible`) builds the NNX train state; the params it
   restored are compared with the converter's bit for bit, its model's forward with the HF logits;
   `load_parameters_path` of the unscanned export with `scan_layers=False` must give the same.
4. MaxText's optimizer (`optimizers.get_optimizer`: optax adamw, b1 0.9, b2 0.95, eps 1e-8,
   wd 0.1 as torchtitan's run, a constant lr equal to torchtitan's next-step lr) steps once from the
   restored opt_state with torchtitan's next-step gradients (mapped into MaxText's layout by hand
   here: kernels transposed and split by heads, experts stacked on a leading axis, q/k rows interleaved, the query's gradient times
   sqrt(head_dim), the gradient of q' = q / sqrt(head_dim)); the result against torchtitan's next
   step; a negative control steps from count 0.
5. MaxText's `checkpointing.save_checkpoint` (its Orbax v1 Checkpointer) writes the stepped train
   state: the case's `ckpt/` (what a MaxText run leaves; the suite imports it as a source).

Weights only (`_maxtext_weights_only.py`, case `maxtext_mistral`): our export of Mistral's reference
checkpoint `mistral_swa` restored by `load_parameters_path` into MaxText's `mistral` block, its
forward against transformers' MistralForCausalLM, saved as MaxText's converters save weights.
Llama 4 (`_maxtext_llama4.py`, cases `maxtext_llama4`, weights, and `maxtext_llama4_adamw`, a torch
FSDP2 AdamW run exported with `--optimizer`, restored and stepped by MaxText). Qwen3-Next
(`_maxtext_qwen3_next.py`, case `maxtext_qwen3_next`, weights: MaxText's `qwen3_next` block ran our
export of hf524_qwen3_next, scanned as `local_layers` / `global_layer` and unscanned).
DeepSeek V3.2 (`_maxtext_deepseek_v32.py`, case `maxtext_deepseek_v32`, weights: our export of
`hf524_deepseek_v32` in MaxText's `deepseek` block, its forward against the case's transformers logits).
The steps those weights cases share (our export scanned and unscanned, MaxText restoring and
running it, the bit-for-bit comparison, the save as weights) are `_maxtext_restore.py`.

Shims (recorded in the manifest): `to_maxtext` reads HF safetensors with `framework="pt"`, which
needs torch (not installed here): the loader is called with `framework="np"`; the converter's HF
config table `HF_MODEL_CONFIGS["llama3.1-8b"]` is replaced by the tiny model's LlamaConfig.
What MaxText cannot express: its llama3.1 RoPE hard-codes the Llama 3.1 scaling constants
(factor 8, low 1, high 4, original context 8192: layers/embeddings.py LLaMARotaryEmbedding); the
torchtitan model has original_max_position_embeddings 16, so the forward reference is the HF model
with the same weights and 8192 (the torchtitan logits differ, recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
# case -> (the torchtitan case it exports, MaxText model name, transformers config class, MaxText
# overrides beyond the sizes, RoPE rows interleaved, query pre-scaled, forward reference)
CASES = {
    "maxtext_llama3": ("torchtitan_llama3", "llama3.1-8b", "LlamaConfig", ["rope_type=llama3.1"], True, True, "hf8192"),
    "maxtext_qwen3": ("torchtitan_qwen3", "qwen3-0.6b", "Qwen3Config", [], False, False, "bf16_tied_head"),
    # every layer MoE; the dense-matmul MoE path (sparse_matmul=False: einsums over every expert,
    # weighted by the routing; megablox's Pallas kernel is TPU/GPU) with capacity_factor -1: dropless
    "maxtext_qwen3_moe": ("torchtitan_qwen3_moe", "qwen3-30b-a3b", "Qwen3MoeConfig",
                          ["sparse_matmul=False", "capacity_factor=-1"], False, False, "fp32"),
}
# this file is `maxtext.py`: with its folder on sys.path, `import maxtext` would find it
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != str(HERE)]
sys.path.insert(0, str(HERE.parent))  # tests/real: tools
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import numpy as np  # noqa: E402
import tools  # noqa: E402

REPO = HERE.parents[2]
SOURCES = REPO / "tests" / "real" / "cases"
STEP = 3
HOST_LOGITS = r"""
import json, sys, numpy as np, torch, transformers
from safetensors.numpy import load_file
ref = load_file(sys.argv[1]); cfg = json.load(open(sys.argv[2])); mode = sys.argv[4]
state = {k[6:]: torch.from_numpy(v) for k, v in ref.items() if k.startswith("param/")}
if mode == "hf8192":  # MaxText's llama3.1 RoPE constants
    cfg["rope_scaling"] = dict(cfg["rope_scaling"], original_max_position_embeddings=8192)
if mode == "bf16_tied_head":  # MaxText's tied logits dot the bf16-cast embedding
    cfg["tie_word_embeddings"] = False
    state["lm_head.weight"] = state["model.embed_tokens.weight"].bfloat16().float()
arch = getattr(transformers, cfg["architectures"][0])
if any(".mlp.experts." in k for k in state):  # per-expert HF names: transformers 5 fuses them on load
    import os, tempfile
    from safetensors.torch import save_file
    folder = tempfile.mkdtemp()
    save_file(state, os.path.join(folder, "model.safetensors"), {"format": "pt"})
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))
    model = arch.from_pretrained(folder, dtype=torch.float32).eval()
else:
    model = arch(getattr(transformers, arch.__name__.replace("ForCausalLM", "Config"))(**cfg)).eval()
    model.load_state_dict(state)
with torch.no_grad():
    out = model(torch.from_numpy(ref["tokens"].astype(np.int64))).logits.numpy()
np.save(sys.argv[3], out)
"""


def sizes(cfg: dict, model_name: str) -> list[str]:
    moe = []
    if cfg.get("num_experts"):  # MaxText's MoE settings (base_mlp_dim: a fully-MoE qwen3_moe wants the experts')
        moe = [f"base_moe_mlp_dim={cfg['moe_intermediate_size']}", f"num_experts={cfg['num_experts']}",
               f"num_experts_per_tok={cfg['num_experts_per_tok']}", f"norm_topk_prob={cfg['norm_topk_prob']}"]
        cfg = {**cfg, "intermediate_size": cfg["moe_intermediate_size"]}
    return [*moe, f"base_emb_dim={cfg['hidden_size']}", f"base_num_query_heads={cfg['num_attention_heads']}",
            f"base_num_kv_heads={cfg['num_key_value_heads']}", f"head_dim={cfg['head_dim']}",
            f"base_mlp_dim={cfg['intermediate_size']}", f"base_num_decoder_layers={cfg['num_hidden_layers']}",
            f"vocab_size={cfg['vocab_size']}", f"rope_max_timescale={int(cfg['rope_theta'])}",
            f"normalization_layer_epsilon={cfg['rms_norm_eps']}", "override_model_config=True",
            f"model_name={model_name}", "hardware=cpu", "skip_jax_distributed_system=True"]


def base_yml() -> str:
    import maxtext

    return str(pathlib.Path(maxtext.__file__).parent / "configs" / "base.yml")


def run_converter(ref: dict, cfg: dict, work: str, model_name: str, cfg_cls: str) -> dict[str, np.ndarray]:
    """MaxText's to_maxtext on the reference params; its checkpoint read back with Orbax."""
    import transformers
    from maxtext.checkpoint_conversion import to_maxtext
    from safetensors.numpy import save_file

    hf = os.path.join(work, "hf")
    os.makedirs(hf)
    save_file({k[6:]: v for k, v in ref.items() if k.startswith("param/")}, os.path.join(hf, "model.safetensors"),
              {"format": "pt"})
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(cfg, f)
    tiny = getattr(transformers, cfg_cls)(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    to_maxtext.HF_MODEL_CONFIGS[model_name] = tiny  # shim: the converter's config table
    real_loader = to_maxtext.load_hf_dict_from_safetensors
    to_maxtext.load_hf_dict_from_safetensors = lambda *a, **k: real_loader(*a, **{**k, "framework": "np"})  # shim
    try:
        return _convert(to_maxtext, work, hf, cfg, model_name)
    finally:
        to_maxtext.load_hf_dict_from_safetensors = real_loader


def _convert(to_maxtext, work, hf, cfg, model_name):
    import orbax.checkpoint as ocp

    out = os.path.join(work, "converted")
    to_maxtext.main(["to_maxtext", base_yml(), f"base_output_directory={out}", "run_name=conv", "scan_layers=True",
                     *sizes(cfg, model_name)], lazy_load_tensors=False, hf_model_path=hf, save_dtype="float32",
                    simulated_cpu_devices_count=1)
    tree = ocp.PyTreeCheckpointer().restore(os.path.join(out, "0", "items"))
    flat = {}

    def walk(node, prefix):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[prefix + k] = np.asarray(v)

    walk(tree["params"]["params"], "")
    return flat


def maxtext_setup(cfg: dict | None, model_name: str, extra: list[str]):
    """MaxText's NNX train state and model for `model_name` resized by `sizes(cfg)` (None: by
    `extra` alone, e.g. an export's maxtext_overrides.json) and `extra`, restored as `extra` says."""
    from flax import nnx
    from flax.linen import partitioning as nn_partitioning
    from maxtext.common import train_state_nnx
    from maxtext.configs import pyconfig
    from maxtext.utils import maxtext_utils, model_creation_utils, train_utils

    config = pyconfig.initialize([
        "gen", base_yml(), *(sizes(cfg, model_name) if cfg is not None else ["hardware=cpu", "skip_jax_distributed_system=True"]), "run_name=gen", "base_output_directory=/tmp/mx-gen",
        "enable_checkpointing=True", "async_checkpointing=False", "dtype=float32", "weight_dtype=float32", "matmul_precision=highest",
        "per_device_batch_size=1", "max_target_length=16", "dataset_type=synthetic", "attention=dot_product",
        "adam_b1=0.9", "adam_b2=0.95", "adam_eps=1e-8", "adam_weight_decay=0.1", *extra])
    mesh = maxtext_utils.get_mesh_from_config(config)
    create, model = model_creation_utils.create_nnx_abstract_model(config, mesh)
    _, tx = train_utils.create_training_optimizer(config, model, mesh=mesh)

    def init_state_fn():
        m = create()
        return train_state_nnx.TrainStateNNX(m, nnx.Optimizer(m, tx, wrt=nnx.Param))

    state, _, _, _, _ = maxtext_utils.setup_training_state(None, config, mesh, None, init_state_fn)
    with nn_partitioning.axis_rules(config.logical_axis_rules):
        module = nnx.merge(nnx.graphdef(nnx.eval_shape(init_state_fn)), state)
    return config, module, state


def flat_params(d: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_params(v, f"{prefix}{k}."))
        elif v is not None:
            out[prefix + str(k)] = np.asarray(v)
    return out


def to_maxtext_layout(hf: dict[str, np.ndarray], cfg: dict, query_factor: float, interleave: bool) -> dict[str, np.ndarray]:
    """HF-named tensors -> MaxText's scanned layout, by hand (as MaxText's hooks: transpose, split
    heads, q/k rows interleaved for llama3.1's RoPE, the query times `query_factor`), layers on axis 1."""
    h, kv, hd, n = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["num_hidden_layers"]

    def inter(w, heads):  # [heads*hd, in] half-split rows -> interleaved per head
        if not interleave:
            return w
        w = w.reshape(heads, 2, hd // 2, -1).transpose(0, 2, 1, 3)
        return w.reshape(heads * hd, -1)

    per = {"self_attention.query.kernel": lambda L: (inter(hf[f"model.layers.{L}.self_attn.q_proj.weight"], h).T.reshape(-1, h, hd) * np.float32(query_factor)).astype(np.float32),
           "self_attention.key.kernel": lambda L: inter(hf[f"model.layers.{L}.self_attn.k_proj.weight"], kv).T.reshape(-1, kv, hd),
           "self_attention.value.kernel": lambda L: hf[f"model.layers.{L}.self_attn.v_proj.weight"].T.reshape(-1, kv, hd),
           "self_attention.out.kernel": lambda L: hf[f"model.layers.{L}.self_attn.o_proj.weight"].T.reshape(h, hd, -1),
           "mlp.wi_0.kernel": lambda L: hf[f"model.layers.{L}.mlp.gate_proj.weight"].T,
           "mlp.wi_1.kernel": lambda L: hf[f"model.layers.{L}.mlp.up_proj.weight"].T,
           "mlp.wo.kernel": lambda L: hf[f"model.layers.{L}.mlp.down_proj.weight"].T,
           "pre_self_attention_layer_norm.scale": lambda L: hf[f"model.layers.{L}.input_layernorm.weight"],
           "post_self_attention_layer_norm.scale": lambda L: hf[f"model.layers.{L}.post_attention_layernorm.weight"]}
    if "model.layers.0.mlp.gate.weight" in hf:  # Qwen3-MoE: the router and the experts (leading axis)
        experts = cfg["num_experts"]
        del per["mlp.wi_0.kernel"], per["mlp.wi_1.kernel"], per["mlp.wo.kernel"]
        per["moe_block.gate.kernel"] = lambda L: hf[f"model.layers.{L}.mlp.gate.weight"].T
        for mt, proj in (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj")):
            per[f"moe_block.{mt}"] = lambda L, proj=proj: np.stack(
                [hf[f"model.layers.{L}.mlp.experts.{e}.{proj}.weight"].T for e in range(experts)])
    if "model.layers.0.self_attn.q_norm.weight" in hf:
        per["self_attention.query_norm.scale"] = lambda L: hf[f"model.layers.{L}.self_attn.q_norm.weight"]
        per["self_attention.key_norm.scale"] = lambda L: hf[f"model.layers.{L}.self_attn.k_norm.weight"]
    out = {f"decoder.layers.{k}": np.stack([fn(L) for L in range(n)], axis=1) for k, fn in per.items()}
    out["token_embedder.embedding"] = hf["model.embed_tokens.weight"]
    out["decoder.decoder_norm.scale"] = hf["model.norm.weight"]
    if "lm_head.weight" in hf:
        out["decoder.logits_dense.kernel"] = hf["lm_head.weight"].T
    return out


def nested(flat: dict[str, np.ndarray]) -> dict:
    out: dict = {}
    for k, v in flat.items():
        node = out
        *parents, leaf = k.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return out


def weights_only():
    """The weights-only cases' generator (`_maxtext_weights_only.py`, loaded by path: this folder is
    off sys.path, see above), bound to this module's helpers."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_maxtext_weights_only", HERE / "_maxtext_weights_only.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.gen = sys.modules[__name__]
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--host-python", default=str(REPO / ".venv" / "bin" / "python"),
                    help="the repository venv's Python (hybridckpt, torch, transformers)")
    extra = weights_only()
    ap.add_argument("--case", choices=sorted([*CASES, *extra.CASES]), action="append", help="default: every case")
    a = ap.parse_args(argv)
    for case in a.case or sorted([*CASES, *extra.CASES]):
        (extra.generate if case in extra.CASES else generate)(case, a.out, a.host_python)
    return 0


def generate(CASE: str, out: str, host_python: str) -> None:  # noqa: N803
    source_case, model_name, cfg_cls, extra, interleave, prescaled, forward = CASES[CASE]
    SOURCE = SOURCES / source_case  # noqa: N806
    import jax
    import optax
    from maxtext.common import checkpointing, train_state_nnx
    from maxtext.optimizers import optimizers
    from safetensors.numpy import load_file

    ref = load_file(str(SOURCE / "reference.safetensors"))
    cfg = json.load(open(SOURCE / "config.json"))
    work = tempfile.mkdtemp(prefix="mx-gen-")
    ours, ours_unscanned = os.path.join(work, "ours"), os.path.join(work, "ours_unscanned")
    host = [host_python, "-m", "hybridckpt.cli", "export", str(SOURCE / "ckpt"), "--to", "maxtext",
            "--config", str(SOURCE / "config.json")]
    subprocess.run([*host[:5], ours, *host[5:], "--optimizer"], check=True)
    subprocess.run([*host[:5], ours_unscanned, *host[5:], "--no-scan-layers"], check=True)
    hf_logits_path = os.path.join(work, "hf_logits.npy")
    subprocess.run([host_python, "-c", HOST_LOGITS, str(SOURCE / "reference.safetensors"),
                    str(SOURCE / "config.json"), hf_logits_path, forward], check=True)
    hf_logits = np.load(hf_logits_path)

    converted = run_converter(ref, cfg, work, model_name, cfg_cls)
    config, module, state = maxtext_setup(cfg, model_name, [*extra, f"load_full_state_path={ours}/{STEP}/items"])
    restored = train_state_nnx.to_checkpoint_dict(state)
    params = flat_params(restored["params"]["params"])
    assert sorted(params) == sorted(converted), (sorted(params), sorted(converted))
    for k in converted:
        assert params[k].dtype == converted[k].dtype and np.array_equal(params[k], converted[k]), k
    assert int(restored["step"]) == STEP and int(restored["opt_state"][0]["count"]) == STEP

    tokens = ref["tokens"].astype(np.int32)
    positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
    logits = np.asarray(module.model(tokens, positions, enable_dropout=False))
    rel = float(np.max(np.abs(logits - hf_logits)) / np.max(np.abs(hf_logits)))
    rel_torchtitan = float(np.max(np.abs(logits - ref["logits"])) / np.max(np.abs(ref["logits"])))
    assert rel < 1e-5, rel

    _, module_unscanned, _ = maxtext_setup(cfg, model_name, [*extra, f"load_parameters_path={ours_unscanned}/{STEP}/items",
                                                              "scan_layers=False"])
    logits_unscanned = np.asarray(module_unscanned.model(tokens, positions, enable_dropout=False))
    assert np.allclose(logits_unscanned, logits, rtol=0, atol=1e-5 * np.max(np.abs(logits)))

    rel_sparse = None
    if "sparse_matmul=False" in extra:  # MoE: MaxText's default path too (megablox grouped matmul, interpreted on CPU)
        _, module_sparse, _ = maxtext_setup(cfg, model_name, [*(x for x in extra if x != "sparse_matmul=False"),
                                                              "sparse_matmul=True", "megablox=True",
                                                              f"load_full_state_path={ours}/{STEP}/items"])
        logits_sparse = np.asarray(module_sparse.model(tokens, positions, enable_dropout=False))
        rel_sparse = float(np.max(np.abs(logits_sparse - hf_logits)) / np.max(np.abs(hf_logits)))
        assert rel_sparse < 1e-5, rel_sparse

    # MaxText's optimizer, one step from the restored opt_state with torchtitan's next-step gradients
    lr = 1e-2 * (1 - (STEP - 2) / 98)  # torchtitan's lr for step 4 (warmup 2, linear decay over 98)
    tx = optimizers.get_optimizer(config, lambda count: lr)
    p = {"params": nested(params)}  # the Linen `params` collection, as MaxText's opt_state mirrors it
    grads = {"params": nested(to_maxtext_layout({k[5:]: v for k, v in ref.items() if k.startswith("grad/")}, cfg,
                                     np.sqrt(cfg["head_dim"]) if prescaled else 1.0, interleave))}
    init = tx.init(p)
    opt = restored["opt_state"]

    def as_optax(count):
        adam = init[0]._replace(count=jax.numpy.asarray(count, jax.numpy.int32), mu=nested(flat_params(opt[0]["mu"])),
                                nu=nested(flat_params(opt[0]["nu"])))
        return (adam, *init[1:])

    def step(count):
        updates, _ = tx.update(grads, as_optax(count), p)
        return flat_params(optax.apply_updates(p, updates)["params"])

    new, control = step(STEP), step(0)
    ref_next = to_maxtext_layout({k[5:]: v for k, v in ref.items() if k.startswith("next/")}, cfg,
                                 1 / np.sqrt(cfg["head_dim"]) if prescaled else 1.0, interleave)
    query = "decoder.layers.self_attention.query.kernel"

    def rel_err(a_, b_):
        return float(np.max(np.abs(a_ - b_)) / np.max(np.abs(b_)))

    errs = {k: rel_err(new[k], ref_next[k]) for k in ref_next}
    control_errs = {k: rel_err(control[k], ref_next[k]) for k in ref_next}
    assert all(e < 1e-5 for k, e in errs.items() if k != query or not prescaled), errs
    if prescaled:
        assert errs[query] > 1e-4, errs[query]  # Adam is not invariant to the rescaling
    assert max(control_errs.values()) > 1e-3, control_errs

    # MaxText writes the stepped train state (its checkpoint layout) with its own Checkpointer: ckpt/
    _, new_opt = tx.update(grads, as_optax(STEP), p)
    count = jax.numpy.asarray(STEP + 1, jax.numpy.int32)
    saved = {"params": {"params": nested(new)}, "step": count,  # as to_checkpoint_dict lays it out
             "opt_state": [{"count": new_opt[0].count, "mu": new_opt[0].mu, "nu": new_opt[0].nu}, None, {"count": count}]}
    case = tools.fresh_case(out, CASE)
    mngr = checkpointing.create_orbax_checkpoint_manager(os.path.join(case, "ckpt"), True, False, 1,
                                                         use_ocdbt=False, use_zarr3=False)
    checkpointing.save_checkpoint(mngr, STEP + 1, saved, config=config, force=True)
    checkpointing.wait_until_finished(mngr)

    arrays = {f"converter/{k}": v for k, v in converted.items()}
    arrays.update({"tokens": ref["tokens"], "logits_hf": hf_logits, "logits_maxtext": logits})
    tools.write_reference(case, arrays)
    if forward == "hf8192":
        logits_ref = ("transformers LlamaForCausalLM of the same params, rope_scaling original_max_position_embeddings "
                      "8192 (what MaxText's llama3.1 RoPE hard-codes)")
        forward_note = (f"forward vs HF logits: max rel {rel:.2e}; vs torchtitan's own logits (original context 16): "
                        f"{rel_torchtitan:.2e}")
    elif forward == "fp32":
        logits_ref = (f"transformers {cfg['architectures'][0]} (from_pretrained of the same params, fp32): the "
                      "model without torchtitan's load-balancing expert bias, which HF has not")
        forward_note = (f"forward vs HF logits: max rel {rel:.2e} (MaxText's dropless dense-matmul MoE: "
                        f"sparse_matmul=False, capacity_factor=-1; top-k then softmax over the k, as HF's "
                        f"norm_topk_prob=true); vs torchtitan's own logits (its experts in bf16, its expert bias in "
                        f"the selection): {rel_torchtitan:.2e}")
    else:
        logits_ref = ("transformers Qwen3ForCausalLM of the same params with the tied head as MaxText computes it: "
                      "the embedding cast to bfloat16 (maxtext 0.2.5 layers/embeddings.py attend_on_embedding)")
        forward_note = (f"forward vs HF logits with a bf16 head: max rel {rel:.2e}; vs torchtitan's own fp32 logits: "
                        f"{rel_torchtitan:.2e} (MaxText's tied logits dot a bf16 copy of the embedding)")
    others = max(e for k, e in errs.items() if k != query or not prescaled)
    step_note = f"next step vs torchtitan's: max rel {others:.2e} on every tensor"
    if prescaled:
        step_note += f" but the query kernel ({errs[query]:.2e}: Adam is not invariant to q' = q / sqrt(head_dim))"
    tools.record_manifest(
        case, tool="maxtext",
        dists=["maxtext", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tensorstore", "transformers", "numpy"],
        command=f"python tests/real/make.py maxtext -- --case {CASE}",
        references={
            "converter/<maxtext path>": f"MaxText's own to_maxtext output (model {model_name}'s hooks, save_dtype "
                                         f"float32, scanned) of {source_case}'s param/<hf>, restored with Orbax",
            "logits_hf": logits_ref,
            "logits_maxtext": "MaxText's forward of our export restored by load_full_state_path (fp32, dot_product)",
            "tokens": f"{source_case}'s tokens",
            "ckpt/": f"MaxText's save_checkpoint of the train state after its optimizer's step {STEP + 1} from our "
                     "export's opt_state with torchtitan's next-step gradients"
                     + (" (the query's times sqrt(head_dim))" if prescaled else ""),
        },
        notes=[
            "shim: to_maxtext's load_hf_dict_from_safetensors called with framework='np' (it asks 'pt', torch is "
            "not installed in this venv)",
            f"shim: to_maxtext.HF_MODEL_CONFIGS[{model_name!r}] replaced by the tiny model's {cfg_cls}",
            "MaxText restored our export (load_full_state_path) with params bit for bit equal to its converter's",
            forward_note,
            f"{step_note}; from count 0 (negative control): {max(control_errs.values()):.2e}",
            *([f"MaxText's default MoE path (sparse_matmul=True, megablox, Pallas interpreted on CPU), dropless: "
               f"forward vs HF logits max rel {rel_sparse:.2e}"] if rel_sparse is not None else []),
            "the unscanned export (--no-scan-layers) restored by load_parameters_path with scan_layers=False gives "
            "the same logits",
        ],
        train={"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "step_saved": STEP + 1},
    )
    print(json.dumps({"case": CASE, "rel_logits": rel, "rel_torchtitan": rel_torchtitan, "errs": errs,
                      "control": control_errs}))


if __name__ == "__main__":
    sys.exit(main())
