"""Pickles read without running them: the restricted machine and the torch.save / paddle.save readers.

Modules, each importing only those above it:

    opcodes       the one opcode walk: DoS guards, pickle ends, payload offsets (Paddle)
    allow         Policy, Token, Frozen, Contextual, Stub: what a pickle may name
    numpy_guard   numpy arrays, dtypes, scalars rebuilt from checked state
    budget        the expansion budget: objects and bytes counted over shared references
    base_policy   BASE_ALLOWED / BASE_POLICY: containers, guarded builtins, numpy
    machine       RestrictedUnpickler, safe_loads, safe_load_file
    torch_policy  TorchDtype, TORCH_DTYPES, TORCH_POLICY, FRAMEWORK_STUBS
    torch_tensors tensor rebuilds and storages: TORCH_SAVE_POLICY
    torch_save    the torch.save zip and legacy containers: `load`
    paddle_save   paddle.save pickles, lazy payloads, PaddleDict: `read`, `safe_load`

Readers of other pickled files (`containers.dcp_metadata`) build on `machine` and `torch_policy`.
"""
