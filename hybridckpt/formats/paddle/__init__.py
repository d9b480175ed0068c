"""PaddleNLP hybrid-parallel checkpoints (Trainer `checkpoint-<step>/`), and single `.pdparams`.

Format (PaddlePaddle/PaddleNLP: paddlenlp/trainer/trainer.py, trainer/utils/sharding_io.py,
trainer/utils/ckpt_converter.py; details and checks in /work/shared/formats/paddle.md):
- `model_state[.SFX].pdparams`: paddle.save state dict `{structured name: array,
  "StructuredToParameterName@@": {structured name: param.name}}` per (tp, pp), or per
  (tp, pp, shard) with `save_sharded_model`. bf16 + sharded save drops the params that have
  master weights (ckpt_converter.py treats files of at most 512 bytes as "not stored"; here the
  contents decide): missing params are rebuilt from the fp32 master weights cast to the model
  dtype (param_meta, else config.json `dtype`).
- `optimizer[.SFX].pdopt`: accumulators `<param.name>[_fp32_master_0]_<acc>_0` (acc: moment1,
  moment2, beta1_pow_acc, beta2_pow_acc for AdamW; velocity for Momentum), returned as the
  slots torch names them (`SLOT_OF_ACCUMULATOR`), `master_weights: {param.name: fp32}` (stage 3:
  `slice@<param.name>`), `LR_Scheduler`. `param.name`s restart on every rank: an accumulator is
  matched to its structured name only through the name table of its own (tp, pp) (the
  model_state files or `model_meta.json` `sharding_metas.tpXX_ppYY.structure_name_mapping`).
- SFX is `tpNN` (tp > 1), `ppNN` (pp > 1), `shardNN` (sharding > 1) joined by `_`; degrees are
  max rank + 1 (or `model_meta.json` `parallel_config`), and every file of the grid must exist.
- Sharding: stage1 v1 / stage2 give whole params to one rank (merge = union); stage1 v2 packs
  params padded into flat buffers split evenly over ranks, each rank keeping a 1-D slice
  (padding included); stage3 slices large params evenly. Both flat layouts rebuild the same
  way: the 1-D pieces in sharding-rank order, concatenated, `[:numel]`, reshaped to the local
  shape (from model_state or `param_meta`). A checkpoint mixing whole and flat layouts, or
  `model_meta.json` strategies, is refused.
- TP: shards of one structured name merge by the `tp` statements of the family's TP rules
  (`rules/paddle_decoder_tp.rules`; never guessed from shapes). PP: files hold global single-card
  names (merge = union); raw PipelineLayer keys (`[_layers.]N.rest`, `shared_layers.<name>.*`)
  are first renamed by the sequential prefixes of PaddleNLP's `<Family>ForCausalLMPipe`.
- bf16 is stored as uint16 bits: model params of dtype uint16 are viewed as bfloat16; moments
  and master weights are fp32.

Returned names are Paddle structured names (`llama.layers.0.self_attn.q_proj.weight`, weights
`[in, out]`); `hf_rules` (the rules of the model family's paddlenlp dialect, e.g.
models/llama/dialects/paddlenlp.rules) maps them to HF names. The optimizer step comes from
`beta1_pow_acc = beta1 ** (step + 1)` (betas from `training_args.bin` when readable, else
Paddle's defaults 0.9 / 0.999); the training step from `trainer_state.json`.

Modules: `files` (the grid of files, model_meta.json, dtypes), `groups` (one (tp, pp) group,
sharding pieces), `optimizer` (accumulators as slots, the step from the beta pows), `rules`
(the families' paddlenlp dialects, structured and pipeline names, rule variables), `hybrid` (`open` of this format,
"paddle"), `unified` (the "paddle-unified" format: reader and writer, PaddleNLP's and
PaddleFormers' flavours), `paddleformers` (what PaddleFormers 1.x's unified checkpoints do
differently: HF names, Linear optimizer state `[in, out]`), `export` (`export --to
paddlenlp-unified|paddleformers-unified`).
"""

from __future__ import annotations

from hybridckpt.formats.paddle.files import BF16, as_model_dtype, config_dtype, scan
from hybridckpt.formats.paddle.hybrid import NAME, detect, open  # noqa: A004 - the format contract
from hybridckpt.formats.paddle.optimizer import (
    BETA_POWS,
    DEFAULT_BETAS,
    SLOT_OF_ACCUMULATOR,
    beta_pow,
    optimizer_step,
    step_from_beta_pow,
)
from hybridckpt.formats.paddle.rules import (
    PaddleFamily,
    families,
    hf_rules,
    load_config,
    rule_variables,
    tp_rules,
)

__all__ = [
    "BETA_POWS",
    "BF16",
    "DEFAULT_BETAS",
    "NAME",
    "SLOT_OF_ACCUMULATOR",
    "PaddleFamily",
    "as_model_dtype",
    "beta_pow",
    "config_dtype",
    "detect",
    "families",
    "hf_rules",
    "load_config",
    "open",
    "optimizer_step",
    "rule_variables",
    "scan",
    "step_from_beta_pow",
    "tp_rules",
]
