"""What makes the PaddleFormers 1.2 Trainer run on a CPU with paddlepaddle 3.3.1's CPU wheel.

Each shim is the smallest stand-in for a GPU-only path; `NOTES` says what each one does and is
copied into every case's manifest. None of them touches how anything is saved: the files are
written by PaddleFormers' and Paddle's own code.

bf16 O2 (`bf16_on_cpu`): on a CPU place `paddle.amp.decorate` returns the model unchanged
(paddle/amp/auto_cast.py `amp_decorate`: "check device_type"), the CPU wheel has no bf16 kernel for
`matmul` or `add`, and `adamw` is registered for float32/float64 only. So:
- `paddle.amp.decorate(level="O2")` runs its GPU path: Paddle's own `amp_initialize` (every param
  cast to bf16) and `_set_multi_precision` on the optimizers;
- the forward runs in fp32: a pre-hook on the top model puts `param.astype("float32")` in place of
  every 16-bit param for the call (a tied param is cast once), so the gradient flows back to the
  bf16 param through the cast, as Paddle's AMP casts do;
- `_C_ops.adamw_` of a 16-bit param with its fp32 master runs Paddle's own fp32 AdamW kernel on
  the master (the grad cast to fp32) and writes `master.astype(bf16)` into the param: what the
  GPU multi-precision kernel does.

Tensor parallel on gloo (`tp_on_cpu`): `broadcast_input_data` asserts a GPU (the inputs of both
ranks are the same batch here: no data parallelism), gloo has no `*_on_calc_stream` collectives,
and the CPU wheel has no `c_identity` / `c_concat` kernels:
- `broadcast_input_data` returns the inputs as they are;
- `ProcessGroup*.all_reduce_on_calc_stream` / `all_gather_into_tensor_on_calc_stream` are the
  synchronous `all_reduce` / `all_gather` of the same group;
- `_C_ops.c_identity` is `paddle.assign` (its backward, an all-reduce, is Paddle's PyLayer);
- `_C_ops.c_concat` is an all-gather + concat on the last axis whose backward takes this rank's
  split (what the kernel pair c_concat / c_split does).
"""

from __future__ import annotations

import importlib

import paddle
from paddle import _C_ops

NOTES: list[str] = []
LOW = (paddle.bfloat16, paddle.float16)


def bf16_on_cpu() -> None:
    auto_cast = importlib.import_module("paddle.amp.auto_cast")
    original = paddle.amp.decorate

    def decorate(models, optimizers=None, level="O1", dtype="float16", master_weight=None,
                 save_dtype=None, master_grad=False, excluded_layers=None):
        if level != "O2":
            return original(models, optimizers, level, dtype, master_weight, save_dtype, master_grad,
                            excluded_layers)
        auto_cast.amp_initialize(models=models if isinstance(models, list) else [models], dtype=dtype,
                                 excluded_layers=excluded_layers)
        if optimizers is None:
            return models
        for opt in optimizers if isinstance(optimizers, list) else [optimizers]:
            auto_cast._set_multi_precision(opt, master_weight is not False)
        return models, optimizers

    paddle.amp.decorate = decorate
    adamw = _C_ops.adamw_

    def adamw_(param, grad, lr, m1, m2, m2max, b1p, b2p, master, found_inf, beta1, beta2, eps,
               lr_ratio, coeff, with_decay, lazy, min_row, multi_precision, global_pow, amsgrad):
        if param.dtype not in LOW:
            return adamw(param, grad, lr, m1, m2, m2max, b1p, b2p, master, found_inf, beta1, beta2,
                         eps, lr_ratio, coeff, with_decay, lazy, min_row, multi_precision, global_pow,
                         amsgrad)
        assert master is not None and multi_precision, param.name
        out = adamw(master, grad.astype("float32"), lr, m1, m2, m2max, b1p, b2p, None, found_inf,
                    beta1, beta2, eps, lr_ratio, coeff, with_decay, lazy, min_row, False, global_pow,
                    amsgrad)
        paddle.assign(master.astype(param.dtype), output=param)
        return out

    _C_ops.adamw_ = adamw_
    NOTES.append(
        "bf16 O2 on CPU (_paddleformers_shims.bf16_on_cpu): paddle.amp.decorate(level='O2') runs "
        "Paddle's amp_initialize + _set_multi_precision (its CPU path returns the model unchanged); "
        "the forward computes in fp32 from param.astype('float32') of the bf16 params (the CPU wheel "
        "has no bf16 matmul/add kernels); _C_ops.adamw_ of a bf16 param runs Paddle's fp32 adamw "
        "kernel on its fp32 master and assigns master.astype(bf16) to the param (the CPU adamw kernel "
        "is float32/float64 only)"
    )


def compute_in_fp32(model) -> None:
    """The forward of `model` from fp32 casts of its 16-bit params (see the module doc)."""
    swapped: list = []

    def pre(layer, inputs):
        cast = {}
        for sub in layer.sublayers(include_self=True):
            for name, p in list(sub._parameters.items()):
                if p is None or p.dtype not in LOW:
                    continue
                if id(p) not in cast:
                    c = p.astype("float32")
                    c.is_distributed = p.is_distributed
                    for attr in ("split_axis", "sequence_parallel", "is_firstly_shared", "color"):
                        if hasattr(p, attr):
                            setattr(c, attr, getattr(p, attr))
                    cast[id(p)] = c
                swapped.append((sub, name, p))
                sub._parameters[name] = cast[id(p)]

    def post(layer, inputs, outputs):
        while swapped:
            sub, name, p = swapped.pop()
            sub._parameters[name] = p

    model.register_forward_pre_hook(pre)
    model.register_forward_post_hook(post)


def tp_on_cpu() -> None:
    import paddle.distributed as dist
    import paddle.distributed.fleet.meta_parallel.tensor_parallel as tensor_parallel
    from paddle.autograd import PyLayer
    from paddle.base import core
    from paddle.distributed.fleet.base import topology

    tensor_parallel.broadcast_input_data = lambda hcg, *inputs, **kwargs: (inputs, kwargs)

    def all_reduce_on_calc_stream(self, tensor, op):
        self.all_reduce(tensor, op, True).wait()

    def all_gather_into_tensor_on_calc_stream(self, out, tensor):
        self.all_gather(out, tensor, True).wait()

    for name in dir(core):
        if name.startswith("ProcessGroup"):
            cls = getattr(core, name)
            cls.all_reduce_on_calc_stream = all_reduce_on_calc_stream
            cls.all_gather_into_tensor_on_calc_stream = all_gather_into_tensor_on_calc_stream
    _C_ops.c_identity = lambda tensor, *args: paddle.assign(tensor)

    class Concat(PyLayer):
        @staticmethod
        def forward(ctx, tensor, rank, nranks, group):
            ctx.rank, ctx.nranks = rank, nranks
            parts: list = []
            dist.all_gather(parts, tensor, group=group)
            return paddle.concat(parts, axis=-1)

        @staticmethod
        def backward(ctx, dy):
            return paddle.split(dy, ctx.nranks, axis=-1)[ctx.rank]

    def c_concat(tensor, rank, nranks, ring_id, *args):
        group = topology._HYBRID_PARALLEL_GROUP.get_model_parallel_group()
        assert group.id == ring_id, (group.id, ring_id)
        return Concat.apply(tensor, rank, nranks, group)

    _C_ops.c_concat = c_concat
    NOTES.append(
        "tensor parallel on gloo (_paddleformers_shims.tp_on_cpu): broadcast_input_data returns the "
        "inputs (it asserts a GPU; both ranks read the same batch); ProcessGroup*.all_reduce_on_calc_"
        "stream / all_gather_into_tensor_on_calc_stream are the synchronous all_reduce / all_gather "
        "(gloo has no calc-stream collectives); _C_ops.c_identity is paddle.assign and _C_ops.c_concat "
        "an all_gather + concat with a split backward (no CPU kernels); tensor_parallel_output=False "
        "(the CPU wheel has no c_softmax_with_cross_entropy kernel)"
    )


def sharding_v2_on_cpu() -> None:
    import paddle.distributed.fleet.utils.tensor_fusion_helper as fusion
    from paddle.base import core

    fusion.__current_device_type__ = "gpu"  # the 256-byte alignment of a GPU run's buffers

    class Done:
        def wait(self):
            return True

        def is_completed(self):
            return True

    def reduce_scatter_tensor(self, out, inp, op, sync_op=True):
        total = inp.clone()
        self.all_reduce(total, op, True).wait()
        part = paddle.split(total.reshape([-1]), self.size())[self.rank()]
        paddle.assign(part.reshape(out.shape), output=out)
        return Done()

    def reduce_scatter_tensor_on_calc_stream(self, out, inp, op):
        return reduce_scatter_tensor(self, out, inp, op)

    for name in dir(core):
        if name.startswith("ProcessGroup"):
            cls = getattr(core, name)
            cls.reduce_scatter_tensor = reduce_scatter_tensor
            cls.reduce_scatter_tensor_on_calc_stream = reduce_scatter_tensor_on_calc_stream
    NOTES.append(
        "sharding stage1 v2 on CPU (_paddleformers_shims.sharding_v2_on_cpu): "
        "tensor_fusion_helper's device type is 'gpu' (it asserts gpu/npu/xpu), so its buffers "
        "take the 256-byte alignment of a GPU run; ProcessGroup*.reduce_scatter_tensor (gloo has "
        "none) is a synchronous all_reduce keeping this rank's equal slice"
    )


def moe_on_cpu() -> None:
    """ERNIE 4.5 MoE's sparse block without its GPU-only kernels (see `MOE_NOTE`)."""
    from paddleformers.transformers.ernie4_5_moe import modeling

    def forward(self, input, token_type_ids=None, use_dense_expert=False):
        shape = input.shape
        x = input.reshape([-1, shape[-1]])
        logits, _, router_loss = self.gate(x, transform_weight=False)  # PaddleFormers' TopKGate, fp32
        prob = self.gate.act(logits)
        choice = prob + self.moe_statics.e_score_correction_bias[0].detach() if self.use_correction_bias else prob
        _, expert_id = choice.topk(k=self.k, axis=-1)
        weight = paddle.take_along_axis(prob, expert_id, axis=-1)  # the plain probabilities
        if self.gate.norm_gate_logits:
            weight = weight / paddle.clip(weight.sum(-1, keepdim=True), min=1e-12)
        weight = weight.cast(x.dtype)
        out = paddle.zeros_like(x)
        for e, expert in enumerate(self.experts):
            w = (weight * (expert_id == e).cast(weight.dtype)).sum(-1, keepdim=True)
            out = out + w * expert(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.reshape(shape), weight, router_loss, logits

    modeling.Ernie4_5_MoeSparseMoeBlock.forward = forward
    NOTES.append(MOE_NOTE)


MOE_NOTE = (
    "ERNIE 4.5 MoE on CPU (_paddleformers_shims.moe_on_cpu): MOEAllGatherLayerV2.forward needs "
    "kernels the CPU wheel lacks (expand_modality_expert_id, moe_gate_dispatch_partial_"
    "nosoftmaxtopk, build_src_rank_and_local_expert_id: 'kernel ... is not registered'); "
    "Ernie4_5_MoeSparseMoeBlock.forward is replaced by the same routing in plain Paddle ops, the "
    "block's own modules: its TopKGate's fp32 logits, gate.act (softmax), top-moe_k of prob + "
    "moe_statics.e_score_correction_bias[0] (fused_gate_logits_process_fused), the plain "
    "probabilities of the chosen experts divided by clip(sum, 1e-12) (norm_gate_logits, "
    "fused_gate_and_dispatch), every chosen expert's MLP, plus the shared experts; no capacity "
    "(no token dropped) and router loss 0 (the aux / z / orthogonal loss lambdas are 0)"
)
