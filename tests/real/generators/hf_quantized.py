"""Quantized Hugging Face releases as the real tools write and read them (FP8 blocks, MXFP4).

    python tests/real/make.py hf_quantized -- --converter FILE --deepseek-kernel FILE

Two files no package index holds, taken from the repositories (never copied into this one):
`--converter` (default ~/.cache/hybridckpt-real/src/convert_gpt_oss_weights_to_hf.py): transformers
@08b031b7 src/transformers/models/gpt_oss/convert_gpt_oss_weights_to_hf.py, its weight conversion
(`write_model`, `save_sharded_model`, `create_safetensors_index`; the tokenizer part, which
downloads o200k_base, and the unpacked non-mxfp4 branch left out); `--deepseek-kernel` (default
~/.cache/hybridckpt-real/src/deepseek_v3_kernel.py): deepseek-ai/DeepSeek-V3@9b4e978
inference/kernel.py as it is.

Cases:
- `hf_fp8_qwen3`: a tiny Qwen3ForCausalLM quantized by transformers 5.24's own fine-grained FP8
  quantizer (`FineGrainedFP8Config(weight_block_size=[16, 16])`, `from_pretrained` quantizing on
  load, then `save_pretrained`): Linear weights float8_e4m3fn + float32 `weight_scale_inv`, the
  embedding, norms and head unquantized, `quantization_config` in config.json. Shim: the
  quantizer's `validate_environment` refuses CPUs ("A GPU or XPU is needed for FP8
  quantization"); it is skipped, everything else (its `Fp8Quantize`, pure torch) runs as written.
  References: transformers' own CPU load of the saved folder (it dequantizes: `dequantize=True`
  on a machine without a GPU): every parameter as it holds them and its logits; and DeepSeek's
  `weight_dequant` (float32) of every quantized weight.
- `deepseek_fp8_partial`: a tiny DeepseekV3ForCausalLM in DeepSeek's release layout with 16 x 16
  blocks over dims that 16 does not divide, so edge blocks are partial (as `kv_a_proj_with_mqa`
  576 x 7168 in 128-blocks of DeepSeek V3). No public tool writes this layout (DeepSeek's FP8
  weights come from its training code; transformers' quantizer leaves a weight whose dims the block
  does not divide unquantized), so the generator quantizes with amax / 448 per block (grid anchored
  at 0) and saves with safetensors; the reference for reading it is DeepSeek's own
  `weight_dequant` kernel (deepseek-ai/DeepSeek-V3@9b4e978 inference/kernel.py, `--deepseek-kernel`,
  run by triton's interpreter on CPU, TRITON_INTERPRET=1), float32. Logits: transformers'
  DeepseekV3ForCausalLM (fp32, eager) holding those float32 values.
  Found: triton's interpreter stores float32 into a bfloat16 pointer by truncation, where the
  GPU's conversion rounds to nearest even, so only the kernel's float32 output is a reference.
- `gpt_oss_mxfp4`: a tiny GPT-OSS in the MXFP4 layout of the hub's release, written by the GPT-OSS
  converter (transformers' convert_gpt_oss_weights_to_hf.py `write_model(..., mxfp4=True)`,
  `--converter`) from a checkpoint in OpenAI's original layout (`block.N.mlp.mlp1_weight.blocks`
  / `.scales` as gpt-oss's `torch/weights.py` reads it) holding seeded random MXFP4 bytes (any
  byte is two valid e2m1 codes) and exponents; shards numbered from 0
  (`model-00000-of-00000.safetensors`). References: transformers 5.24's CPU load (it dequantizes,
  `convert_moe_packed_tensors`), float32: every parameter (`mlp.experts.gate_up_proj`
  `[E, hidden, 2 * intermediate]`) and its logits.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile

import numpy as np
import tools
import torch

TOKENS = np.random.default_rng(9).integers(0, 64, size=(2, 6)).astype(np.int64)
FP8_MAX = 448.0
DISTS = ["transformers", "torch", "triton", "accelerate", "safetensors", "numpy"]


def _randomize(model, std: float = 0.2) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def _deepseek_kernel(path: str):
    os.environ["TRITON_INTERPRET"] = "1"
    spec = importlib.util.spec_from_file_location("deepseek_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _weight_dequant(kernel, q: torch.Tensor, s: torch.Tensor, block: int) -> torch.Tensor:
    """DeepSeek's weight_dequant, float32 (its default dtype), per 2-D matrix."""
    torch.set_default_dtype(torch.float32)
    return kernel.weight_dequant(q.contiguous(), s.contiguous(), block)


def _logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS)).logits.float().numpy()


def fp8_qwen3(out: str, kernel) -> None:
    import transformers
    from transformers import (
        AutoModelForCausalLM,
        FineGrainedFP8Config,
        Qwen3Config,
        Qwen3ForCausalLM,
    )
    from transformers.quantizers import quantizer_finegrained_fp8 as qf

    case = tools.fresh_case(out, "hf_fp8_qwen3")
    ckpt = os.path.join(case, "ckpt")
    cfg = Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, vocab_size=64, max_position_embeddings=64,
                      tie_word_embeddings=False)
    with tempfile.TemporaryDirectory() as base:
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
        _randomize(model)
        model.save_pretrained(base)
        check = qf.FineGrainedFP8HfQuantizer.validate_environment
        qf.FineGrainedFP8HfQuantizer.validate_environment = lambda self, *a, **k: None  # the CPU refusal only
        quant = AutoModelForCausalLM.from_pretrained(
            base, quantization_config=FineGrainedFP8Config(weight_block_size=[16, 16]), dtype=torch.bfloat16)
        quant.save_pretrained(ckpt)
        qf.FineGrainedFP8HfQuantizer.validate_environment = check  # reading back: the tool as it is
    from safetensors.torch import load_file

    stored = load_file(os.path.join(ckpt, "model.safetensors"))
    refs = {}
    for name, s in stored.items():
        if name.endswith("weight_scale_inv"):
            w = name[: -len("_scale_inv")]
            refs[f"deepseek_weight_dequant:{w}"] = _weight_dequant(kernel, stored[w], s, 16).numpy()
    back = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    refs |= {f"transformers:{k}": v.detach().float().numpy() for k, v in back.named_parameters()}
    refs |= {"logits": _logits(back), "tokens": TOKENS}
    tools.write_reference(case, refs)
    tools.record_manifest(
        case, tool=f"transformers {transformers.__version__} FineGrainedFP8Config quantizer + save_pretrained",
        dists=DISTS, command="python tests/real/make.py hf_quantized",
        references={"deepseek_weight_dequant:<name>": "DeepSeek's weight_dequant (triton interpreter), float32",
                    "transformers:<name>": "each parameter of transformers' CPU load of ckpt/ (dequantize=True), float32",
                    "logits": "that model's forward (fp32, eager)", "tokens": "input ids"},
        notes=["shim: FineGrainedFP8HfQuantizer.validate_environment skipped (it refuses CPU quantization)",
               f"transformers dequantized on load: {type(back.model.layers[0].mlp.up_proj).__name__} modules"],
        files=sorted(os.listdir(ckpt)))
    print("hf_fp8_qwen3", sorted(stored)[:6])


def _quantize_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn values and float32 multipliers per block (amax / 448; grid anchored at 0)."""
    m, n = w.shape
    gm, gn = -(-m // block), -(-n // block)
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    s = torch.empty(gm, gn, dtype=torch.float32)
    w = w.float()
    for i in range(gm):
        for j in range(gn):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale = tile.abs().amax().clamp(min=1e-4) / FP8_MAX
            s[i, j] = scale
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / scale).to(torch.float8_e4m3fn)
    return q, s


def deepseek_fp8_partial(out: str, kernel) -> None:
    import transformers
    from safetensors.torch import save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    case = tools.fresh_case(out, "deepseek_fp8_partial")
    ckpt = os.path.join(case, "ckpt")
    block = 16
    cfg = DeepseekV3Config(
        vocab_size=64, hidden_size=40, intermediate_size=56, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=20, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=12, max_position_embeddings=64, tie_word_embeddings=False,
        rope_scaling=None)
    model = DeepseekV3ForCausalLM(cfg).eval()
    _randomize(model)
    model.save_pretrained(ckpt)
    from safetensors.torch import load_file

    sd = load_file(os.path.join(ckpt, "model.safetensors"))
    os.remove(os.path.join(ckpt, "model.safetensors"))
    stored, refs, deq = {}, {}, {}
    for name, t in sd.items():
        keep = name.endswith(".weight") and t.ndim == 2 and "norm" not in name and "embed_tokens" not in name \
            and "lm_head" not in name and not name.endswith("mlp.gate.weight")
        if keep:
            q, s = _quantize_blocks(t, block)
            stored[name], stored[name + "_scale_inv"] = q, s
            deq[name] = _weight_dequant(kernel, q, s, block)
            refs[f"deepseek_weight_dequant:{name}"] = deq[name].numpy()
        else:
            stored[name] = t
    save_file(stored, os.path.join(ckpt, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(ckpt, "config.json")) as f:
        doc = json.load(f)
    doc["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [block, block]}
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(doc, f, indent=2)
    with tempfile.TemporaryDirectory() as plain:  # the dequantized values, read by transformers' own loader
        save_file({k: deq.get(k, t).float().contiguous() for k, t in sd.items()}, os.path.join(plain, "model.safetensors"),
                  metadata={"format": "pt"})
        with open(os.path.join(plain, "config.json"), "w") as f:
            json.dump({k: v for k, v in doc.items() if k != "quantization_config"}, f)
        back = DeepseekV3ForCausalLM.from_pretrained(plain, dtype=torch.float32, attn_implementation="eager").eval()
        logits = _logits(back)
    refs |= {f"unquantized:{k}": v.float().numpy() for k, v in sd.items() if k not in deq}
    refs |= {"logits": logits, "tokens": TOKENS}
    partial = sorted(k for k, t in sd.items() if k in deq and (t.shape[0] % block or t.shape[1] % block))
    tools.write_reference(case, refs)
    tools.record_manifest(
        case, tool="the generator's amax/448 block quantizer (DeepSeek's layout; no public tool writes it), "
                   f"transformers {transformers.__version__} save_pretrained for the unquantized model",
        dists=DISTS, command="python tests/real/make.py hf_quantized",
        references={"deepseek_weight_dequant:<name>": "DeepSeek's weight_dequant (triton interpreter), float32",
                    "unquantized:<name>": "the tensors stored unquantized",
                    "logits": "transformers' DeepseekV3ForCausalLM (fp32, eager) from_pretrained of the "
                              "dequantized values (float32 safetensors beside the config)",
                    "tokens": "input ids"},
        notes=["triton's interpreter stores float32 to a bfloat16 pointer by truncation (the GPU rounds to "
               "nearest even): the kernel's bfloat16 output is not a reference here, its float32 output is",
               f"weights with partial edge blocks: {partial}"],
        files=sorted(os.listdir(ckpt)))
    print("deepseek_fp8_partial", len(partial), "weights with partial blocks")


def _original_gpt_oss(folder: str, h: int, inter: int, e: int, layers: int, heads: int, kv: int, hd: int,
                      vocab: int) -> None:
    """A checkpoint in OpenAI's original layout (gpt_oss/torch/weights.py names), seeded."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)

    def randn(*shape, std=0.2):
        return (std * torch.randn(shape, generator=g)).to(torch.bfloat16)

    def mx(rows: int, cols: int):
        blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
        scales = torch.randint(120, 126, (e, rows, cols // 32), generator=g, dtype=torch.int32).to(torch.uint8)
        return blocks, scales

    sd = {"embedding.weight": randn(vocab, h), "norm.scale": 1 + randn(h).float(), "unembedding.weight": randn(vocab, h)}
    for n in range(layers):
        b = f"block.{n}"
        sd |= {f"{b}.attn.norm.scale": 1 + randn(h).float(), f"{b}.attn.qkv.weight": randn((heads + 2 * kv) * hd, h),
               f"{b}.attn.qkv.bias": randn((heads + 2 * kv) * hd), f"{b}.attn.sinks": randn(heads).float(),
               f"{b}.attn.out.weight": randn(h, heads * hd), f"{b}.attn.out.bias": randn(h),
               f"{b}.mlp.norm.scale": 1 + randn(h).float(), f"{b}.mlp.gate.weight": randn(e, h, std=1.0),
               f"{b}.mlp.gate.bias": randn(e), f"{b}.mlp.mlp1_bias": randn(e, 2 * inter),
               f"{b}.mlp.mlp2_bias": randn(e, h)}
        sd[f"{b}.mlp.mlp1_weight.blocks"], sd[f"{b}.mlp.mlp1_weight.scales"] = mx(2 * inter, h)
        sd[f"{b}.mlp.mlp2_weight.blocks"], sd[f"{b}.mlp.mlp2_weight.scales"] = mx(h, inter)
    save_file(sd, os.path.join(folder, "model.safetensors"))
    cfg = {"num_hidden_layers": layers, "num_experts": e, "experts_per_token": 2, "vocab_size": vocab,
           "hidden_size": h, "intermediate_size": inter, "swiglu_limit": 7.0, "head_dim": hd,
           "num_attention_heads": heads, "num_key_value_heads": kv, "sliding_window": 4,
           "initial_context_length": 64, "rope_theta": 150000, "rope_scaling_factor": 32.0, "rope_ntk_alpha": 1,
           "rope_ntk_beta": 32}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)


def gpt_oss_mxfp4(out: str, converter: str) -> None:
    import transformers
    from transformers import GptOssForCausalLM

    spec = importlib.util.spec_from_file_location("convert_gpt_oss", converter)
    conv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conv)
    case = tools.fresh_case(out, "gpt_oss_mxfp4")
    ckpt = os.path.join(case, "ckpt")
    with tempfile.TemporaryDirectory() as orig:
        _original_gpt_oss(orig, h=64, inter=32, e=4, layers=2, heads=4, kv=2, hd=16, vocab=64)
        conv.write_model(model_path=ckpt, input_base_path=orig, mxfp4=True)
    back = GptOssForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    refs = {f"transformers:{k}": v.detach().float().numpy() for k, v in back.named_parameters()}
    refs |= {"logits": _logits(back), "tokens": TOKENS}
    tools.write_reference(case, refs)
    tools.record_manifest(
        case, tool=f"transformers convert_gpt_oss_weights_to_hf.py write_model(mxfp4=True) "
                   f"(huggingface/transformers@08b031b7), transformers {transformers.__version__}",
        dists=DISTS + ["tiktoken"], command=f"python tests/real/make.py hf_quantized -- --converter {converter}",
        references={"transformers:<name>": "each parameter of transformers' CPU load of ckpt/ (MXFP4 dequantized "
                                           "by convert_moe_packed_tensors), float32",
                    "logits": "that model's forward (fp32, eager)", "tokens": "input ids"},
        notes=["input: OpenAI's original layout with seeded random MXFP4 bytes and exponents 120..125",
               "the converter's tokenizer step (tiktoken o200k_base from the network) is not run"],
        files=sorted(os.listdir(ckpt)))
    print("gpt_oss_mxfp4", sorted(os.listdir(ckpt)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--converter", default=os.path.expanduser("~/.cache/hybridckpt-real/src/convert_gpt_oss_weights_to_hf.py"))
    ap.add_argument("--deepseek-kernel", default=os.path.expanduser("~/.cache/hybridckpt-real/src/deepseek_v3_kernel.py"))
    ap.add_argument("--case", action="append")
    a = ap.parse_args()
    for path in (a.converter, a.deepseek_kernel):
        if not os.path.isfile(path):
            raise SystemExit(f"hf_quantized: {path} missing (see the module doc for where it comes from)")
    kernel = _deepseek_kernel(a.deepseek_kernel)
    todo = a.case or ["hf_fp8_qwen3", "deepseek_fp8_partial", "gpt_oss_mxfp4"]
    if "hf_fp8_qwen3" in todo:
        fp8_qwen3(a.out, kernel)
    if "deepseek_fp8_partial" in todo:
        deepseek_fp8_partial(a.out, kernel)
    if "gpt_oss_mxfp4" in todo:
        gpt_oss_mxfp4(a.out, a.converter)
    return 0


if __name__ == "__main__":
    sys.exit(main())
