"""MaxText 0.2.5 runs a weights-only export: Mistral (Mistral's reference checkpoint, no optimizer
state) in MaxText's `mistral` decoder block. A part of `maxtext.py` (which loads this file and sets
`gen` to itself: its helpers `maxtext_setup`, `flat_params`, `nested`, `tools`, `SOURCES`).

    python tests/real/make.py maxtext -- --case maxtext_mistral
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

import numpy as np

gen = None  # the maxtext generator module (set by it)

# weights-only cases: case -> (the source case, MaxText model name); the generator of each but
# Mistral is `_<case>.py` (`_maxtext_llama4.py` for both Llama 4 cases; loaded by `part()`)
CASES = {"maxtext_mistral": ("mistral_swa", "mistral-7b"), "maxtext_llama4": ("hf524_llama4", "llama4-17b-16e"),
         "maxtext_llama4_adamw": ("hf524_llama4", "llama4-17b-16e"),
         "maxtext_qwen3_next": ("hf524_qwen3_next", "qwen3-next-80b-a3b"),
         "maxtext_deepseek_v32": ("hf524_deepseek_v32", "deepseek3.2-671b"),
         "maxtext_gpt_oss": ("gpt_oss_mxfp4", "gpt-oss-20b")}


def part(name: str):
    """`<name>.py` of this folder (`_maxtext_llama4`, ...; loaded by path, as this file is), bound to
    the maxtext generator (`gen`) and, but for that file itself, to `_maxtext_restore.py` (`steps`),
    the steps the weights cases share."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).parent / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.gen = gen
    if name != "_maxtext_restore":
        mod.steps = part("_maxtext_restore")
    return mod


HOST_MISTRAL = r"""
import json, sys, numpy as np, torch, transformers
from safetensors.numpy import load_file
ref = load_file(sys.argv[1]); hf = json.load(open(sys.argv[2]))["hf_config"]
state = {k: torch.from_numpy(v) for k, v in ref.items() if k.startswith(("model.", "lm_head."))}
out = {}
for name, window in (("global", None), ("window", hf["sliding_window"])):
    cfg = transformers.MistralConfig(**{**hf, "sliding_window": window}, attn_implementation="eager")
    model = transformers.MistralForCausalLM(cfg).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        out[name] = model(torch.from_numpy(ref["tokens"].astype(np.int64))).logits.numpy()
np.savez(sys.argv[3], **out)
"""


def generate(CASE: str, out: str, host_python: str) -> None:  # noqa: N803
    """Mistral (weights only): our export of the Mistral reference checkpoint restored by MaxText's
    `load_parameters_path` into its `mistral` decoder block, its forward against transformers'
    MistralForCausalLM of the same weights, then saved as MaxText's converter saves weights
    (`TrainState(step=0, params, opt_state={})` through `checkpointing.save_checkpoint`)."""
    if CASE.startswith("maxtext_llama4"):
        return part("_maxtext_llama4").generate(CASE, out, host_python)
    if CASE in ("maxtext_qwen3_next", "maxtext_deepseek_v32", "maxtext_gpt_oss"):
        return part("_" + CASE).generate(CASE, out, host_python)
    from safetensors.numpy import load_file

    steps = part("_maxtext_restore")

    source_case, model_name = CASES[CASE]
    SOURCE = gen.SOURCES / source_case  # noqa: N806
    ref = load_file(str(SOURCE / "reference.safetensors"))
    hf = json.load(open(SOURCE / "manifest.json"))["hf_config"]
    cfg = {"hidden_size": hf["hidden_size"], "num_attention_heads": hf["num_attention_heads"],
           "num_key_value_heads": hf["num_key_value_heads"], "head_dim": hf["head_dim"],
           "intermediate_size": hf["intermediate_size"], "num_hidden_layers": hf["num_hidden_layers"],
           "vocab_size": hf["vocab_size"], "rope_theta": hf["rope_theta"], "rms_norm_eps": hf["rms_norm_eps"]}
    work = tempfile.mkdtemp(prefix="mx-gen-")
    ours = os.path.join(work, "ours")
    subprocess.run([host_python, "-m", "hybridckpt.cli", "export", str(SOURCE / "ckpt"), ours, "--to", "maxtext"],
                   check=True)
    overrides = json.load(open(os.path.join(ours, "maxtext_overrides.json")))
    logits_path = os.path.join(work, "hf_logits.npz")
    subprocess.run([host_python, "-c", HOST_MISTRAL, str(SOURCE / "reference.safetensors"), str(SOURCE / "manifest.json"),
                    logits_path], check=True)
    hf_logits = dict(np.load(logits_path))
    config, module, state = gen.maxtext_setup(cfg, model_name, [f"load_parameters_path={ours}/0/items"])
    assert config.decoder_block.value == "mistral", config.decoder_block
    tokens = ref["tokens"].astype(np.int32)
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    logits = np.asarray(module.model(tokens, positions, enable_dropout=False))

    rel_global, rel_window = steps.rel(logits, hf_logits["global"]), steps.rel(logits, hf_logits["window"])
    assert rel_global < 1e-5, rel_global
    assert rel_window > 1e-2, rel_window  # MaxText's mistral block attends globally: the window is not kept

    from maxtext.common import train_state_nnx

    params = gen.flat_params(train_state_nnx.to_checkpoint_dict(state)["params"]["params"])
    case = steps.save_weights(out, CASE, params, config)
    gen.tools.write_reference(case, {"tokens": ref["tokens"], "logits_hf_global": hf_logits["global"],
                                 "logits_hf_window": hf_logits["window"], "logits_maxtext": logits})
    gen.tools.record_manifest(
        case, tool="maxtext",
        dists=steps.DISTS_HF,
        command=f"python tests/real/make.py maxtext -- --case {CASE}",
        hf_config=hf, overrides=overrides,
        references={
            "logits_hf_global": f"transformers MistralForCausalLM (eager, fp32) of {source_case}'s weights, sliding_window None",
            "logits_hf_window": f"the same with {source_case}'s sliding_window {hf['sliding_window']} (the source model)",
            "logits_maxtext": "MaxText's forward (decoder_block mistral, fp32) of our export restored by load_parameters_path",
            "tokens": f"{source_case}'s tokens",
            "ckpt/": "MaxText's save_checkpoint of the params it restored, as its converters save weights "
                     "(TrainState step 0, opt_state {})",
        },
        notes=[
            f"our `export --to maxtext` of {source_case} (Mistral's reference checkpoint, weights only) restored by "
            "MaxText's load_parameters_path into its mistral decoder block (model mistral-7b resized by the overrides)",
            f"forward vs HF logits without the window: max rel {rel_global:.2e}; vs the windowed source model: "
            f"{rel_window:.2e} (MaxText's mistral block attends globally: models/mistral.py builds its Attention "
            "without attention_type, so sliding_window_size is not applied)",
            "no MaxText converter output as reference: to_maxtext has no mistral-7b mapping (param_mapping.py "
            "PARAM_MAPPING), and standalone_scripts/llama_or_mistral_ckpt.py reads with torch (safe_open "
            "framework='pt', tensor.to(torch.float32)), which has no CPU wheel for this Python 3.12 venv here",
        ],
    )
    print(json.dumps({"case": CASE, "rel_global": rel_global, "rel_window": rel_window}))
