"""Every checkpoint format, ours included: the one registry of what can be read and written.

A `Format` names its reader (a module of `hybridckpt/formats/` with `detect(path) -> bool`, cheap:
file names and a few bytes, and cheap to import: `detect` tries the formats in order on every source,
so a package imports its detect module and loads its `open` on first use; `open(path, *, config=None) -> SourceCheckpoint`, pure planning from
metadata, no tensor bytes read; and, where its folders may hold several steps (`step-N/`,
`checkpoint-N/`, `iter_N/`, `global_stepN/`, `N/`), `steps(path) -> io.step_folders.StepFolders |
None`) and its writer (`write(request: writers.ExportRequest) -> writers.Written`), each as
"module:function" so that listing the names (`--format`, `--to`) imports nothing. `FORMATS` is in
detection order, most specific first; a format without a reader is one `--to` offers only (read
back as another: torchtitan's folder is a DCP folder), one without a writer is read only.
A new format is its package under `formats/` and one line here.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from hybridckpt import values
from hybridckpt.errors import CheckpointError, ConfigError, FormatError, short_repr
from hybridckpt.formats.model_config import config_arg, model_files_of
from hybridckpt.io.remote.view import displayed, local_path, url_of
from hybridckpt.io.step_folders import StepFolders
from hybridckpt.lazy import shape_problem
from hybridckpt.optim.groups import checked_hyper
from hybridckpt.source_checkpoint import SourceCheckpoint


@dataclass(frozen=True)
class Format:
    """One format. name: `--format NAME`; detect/open/write: "module:function" of its reader's
    `detect` and `open` and of its writer (None: not read / not written); to: its `--to` name when
    that is not `name` (Megatron's torch_dist layout is `--to megatron`); options: the writer
    options it takes (`ExportRequest.options` keys) -> the CLI flag that sets each, for messages;
    about: one line on what its writer writes (the CLI's help); check: "module:function" that
    checks its options' values (with whether the optimizer is asked for) before anything is read;
    names: "module:function(src, config, param_order, rules=) -> SourceCheckpoint" that names
    what its reader leaves unnamed until the model config is known (an optimizer state keyed by
    parameter index: `formats.index_naming`), run by `open_source` right after the reader;
    knobs: the export knobs beside `options` its writer honours (`KNOBS`; `writing` refuses the others)."""

    name: str
    detect: str | None = None
    open: str | None = None  # noqa: A003 - the format contract's name
    write: str | None = None
    to: str | None = None
    options: Mapping[str, str] = field(default_factory=dict)
    about: str = ""  # what its writer writes, for `--to`'s help
    check: str | None = None  # "module:function(options, optimizer)": its options checked before any read
    names: str | None = None  # "module:function": names its reader's index-keyed optimizer state
    knobs: tuple[str, ...] = ()  # the `ExportRequest` knobs its writer honours: "max_shard_bytes", "direct_io"

    @property
    def reader(self):
        """The reader's module (its `detect`, `open` and `steps`)."""
        return importlib.import_module(self.open.partition(":")[0])

    def call(self, which: str, *args, **kwargs):
        """Call this format's `detect`, `open` or `write` (imported on first use)."""
        module, _, function = getattr(self, which).partition(":")
        return getattr(importlib.import_module(module), function)(*args, **kwargs)


def _reads(name: str, module: str, **more) -> Format:
    return Format(name, f"{module}:detect", f"{module}:open", **more)


F = "hybridckpt.formats"
BY_INDEX = f"{F}.index_naming:name_index_keyed"  # readers that may find an optimizer state keyed by index
# in detection order, most specific first
FORMATS: tuple[Format, ...] = (
    _reads("orbax", f"{F}.orbax_store"),  # ours: written by `hybridckpt import` / CheckpointStore
    _reads("maxtext", f"{F}.maxtext", write=f"{F}.maxtext.write:write_export",
           options={"scan_layers": "--no-scan-layers"},
           about="MaxText's train state OUT/<step>/items (load_parameters_path / load_full_state_path; "
                 "docs/maxtext.md)"),  # <step>/items of MaxText's train state
    _reads("megatron", f"{F}.megatron"),
    _reads("meta-llama", f"{F}.meta_llama"),
    _reads("megatron-dist", f"{F}.megatron_dist", write=f"{F}.megatron_dist.write:write_request", to="megatron",
           options={"tp": "--tp", "pp": "--pp"}, knobs=("max_shard_bytes", "direct_io"),
           about="a Megatron-Core torch_dist checkpoint (iter_N/) Megatron-LM loads at any tp/pp "
                 "(docs/torch-export.md)"),  # before dcp: a torch_dist folder is a DCP folder too
    _reads("flex-checkpoint", f"{F}.flex_checkpoint"),  # Paddle's {id}.metadata + {rank}_{id}.distcp
    _reads("hf-trainer", f"{F}.trainer", names=BY_INDEX),  # before dcp, deepspeed and hf: a layer over their files
    _reads("lightning", f"{F}.lightning", names=BY_INDEX),  # before dcp and torch: a .ckpt/ folder is DCP, a .ckpt file torch
    _reads("dcp", f"{F}.dcp", write=f"{F}.dcp.write:write_request", options={"files": "--writers"}, knobs=("max_shard_bytes", "direct_io"),
           about="a torch Distributed Checkpoint FSDP2 resumes on any number of ranks (get_state_dict + "
                 "dcp.load + set_state_dict)"),
    Format("torchtitan", write=f"{F}.dcp.write_torchtitan:write_request", options={"files": "--writers"}, knobs=("max_shard_bytes", "direct_io"),
           about="a CheckpointManager folder (step-N/) torchtitan 0.3 resumes"),  # read back as dcp
    _reads("deepspeed-universal", f"{F}.deepspeed.universal"),  # before deepspeed: its tag holds mp_rank_00_model_states.pt
    _reads("deepspeed", f"{F}.deepspeed"),
    _reads("paddle", f"{F}.paddle"),
    _reads("paddle-unified", f"{F}.paddle.unified"),
    Format("paddlenlp-unified", write=f"{F}.paddle.write_unified:write_export", knobs=("max_shard_bytes",),
           about="a PaddleNLP unified checkpoint (its names, Linear weights [in, out]; optimizer-*/master_weights-*, "
                 "fp32 masters when --dtype is 16-bit)"),  # read back as paddle-unified
    Format("paddleformers-unified", write=f"{F}.paddle.write_unified:write_export", knobs=("max_shard_bytes",),
           about="a PaddleFormers unified checkpoint (HF names, [out, in] weights, optimizer state [in, out])"),
    _reads("colossal", f"{F}.colossal"),
    _reads("hf", f"{F}.hf", write=f"{F}.hf.write:write_export", check=f"{F}.hf.write:check_options", knobs=("max_shard_bytes", "direct_io"),
           options={"optimizer_layout": "--optimizer-layout"},
           about="an HF single-card safetensors folder (the default; with --optimizer the slots as "
                 "optimizer*.safetensors)"),
    _reads("torch", f"{F}.torch_file", names=BY_INDEX),  # last: any torch.save file of a state dict, by its bytes
)
READABLE: tuple[Format, ...] = tuple(f for f in FORMATS if f.open is not None)
NAMES: tuple[str, ...] = tuple(f.name for f in READABLE)  # what `--format` accepts
WRITABLE: dict[str, Format] = {"hf": next(f for f in FORMATS if f.name == "hf")}  # the default first
WRITABLE.update({f.to or f.name: f for f in FORMATS if f.write is not None})
TO_NAMES: tuple[str, ...] = tuple(WRITABLE)  # what `--to` accepts, the default first


KNOBS = {"max_shard_bytes": ("--max-shard-gb", "max_shard_bytes="), "direct_io": ("--buffered-writes", "direct_io=False")}


def knob_takers(knob: str) -> str:
    """The `--to` names whose writer honours `knob` (a key of `KNOBS`)."""
    return ", ".join(t for t, f in WRITABLE.items() if knob in f.knobs)


def takers(option: str) -> str:
    """The `--to` names whose writer takes `option`, joined for a message ("dcp or torchtitan")."""
    return " or ".join(t for t, f in WRITABLE.items() if option in f.options)


def reading(name: str) -> Format:
    """The readable format `name`, or a FormatError listing them."""
    for f in READABLE:
        if f.name == name:
            return f
    raise FormatError(f"unknown format {name!r} (known: {', '.join(NAMES)})")


def writing(to: str, options: Mapping[str, object] = {}, optimizer: bool | None = None,  # noqa: B006 - read only
            knobs: tuple[str, ...] = ()) -> Format:
    """The format `--to to` writes, or a ConfigError listing them; a ConfigError too for any of
    `options` (writer options) it does not take, any of `knobs` (those of `KNOBS` given, e.g.
    "direct_io" for --buffered-writes) its writer does not honour or, given `optimizer` (whether
    the optimizer state is asked for), its `check` refuses: a flag honoured or refused, never ignored."""
    if to not in WRITABLE:
        raise ConfigError(f"--to {to!r}: expected one of {', '.join(TO_NAMES)}")
    fmt = WRITABLE[to]
    for key in options:
        if key not in fmt.options:
            flag = next((f.options[key] for f in WRITABLE.values() if key in f.options), key)
            raise ConfigError(f"{flag}: only for --to {takers(key) or '(none)'} (not --to {to})")
    if fmt.check is not None and optimizer is not None:
        fmt.call("check", options, optimizer)
    for knob in knobs:
        if knob not in fmt.knobs:
            flag, arg = KNOBS[knob]
            why = f"only for --to {knob_takers(knob)} (--to {to} writes its files its own way)"
            raise ConfigError(f"{arg}: {why}", cli=f"{flag}: {why}")
    return fmt


def write(request):
    """Write `request` (`writers.ExportRequest`) in the format its `layout` names, after refusing
    any option that format does not take (a flag honoured or refused, never ignored). Each writer
    checks the destination first, before it reads a byte (`writers.preflight`)."""
    return writing(request.layout, request.options).call("write", request)


def available() -> list[str]:
    """Names of the formats this installation can read."""
    return list(NAMES)


def detect(path: str) -> str:
    """The name of the format of `path`, or a FormatError listing what was looked for."""
    path = local_path(path)  # a URL: its local view (`io.remote.view`)
    if not os.path.exists(path):
        raise FormatError(f"{path}: no such file or directory")
    for f in READABLE:
        if f.call("detect", path):
            return f.name
    raise FormatError(f"{path}: not a checkpoint of any known format (known: {', '.join(NAMES)})")


def step_folders(path: str, fmt: str = "auto") -> StepFolders | None:
    """The step folders of `path` when it is an output folder of several steps of format `fmt`
    (`io.step_folders`: names only), else None."""
    path = local_path(path)
    mod = reading(detect(path) if fmt == "auto" else fmt).reader
    return mod.steps(path) if hasattr(mod, "steps") else None


def store_view(path: str) -> str:
    """`path` itself, or for a URL (`s3://bucket/ck`) of our store the local view it is read through
    (`io.remote.view`: metadata downloaded, raw chunks read by ranged GETs), once its commit marker
    is found (`io.remote.commit.require_committed`); never a local folder named `s3:`."""
    from hybridckpt.io.remote import commit, urls

    url = urls.parse(path)
    if url is None:
        return path
    commit.require_committed(urls.filesystem(url), url)
    return local_path(path)


def require_store(path: str) -> str:
    """`path` is a folder that may hold our checkpoints (`DIR` or `DIR/<step>`), or a CheckpointError
    saying what it is instead: absent (nothing is created), not a folder, or another format's
    checkpoint, which becomes one of ours by an import. A folder of no known format passes (a
    training loop's store before its first save): the store says it has no steps. Returns the
    folder to read (a URL's local view, `store_view`)."""
    path = store_view(path)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such folder (expected one of our checkpoints: `hybridckpt import` or "
                              f"CheckpointStore writes them)")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a folder (expected one of our checkpoints, a folder)")
    for f in READABLE:
        if f.call("detect", path):
            name = f.name
            if name == "orbax":
                return path
            raise CheckpointError(
                f"{path} is a {name} checkpoint, not a hybridckpt store; import it first: "
                f"hybridckpt.import_checkpoint({str(path)!r}, DST)",
                cli=f"{path} is a {name} checkpoint, not a hybridckpt store; import it first: "
                    f"hybridckpt import {path} DST")
    return path


def open_source(path: str, fmt: str = "auto", *, config=None, step: int | None = None,
                verify_reads: bool = True, param_order=None, rules=None) -> SourceCheckpoint:
    """Open `path` (made absolute; an empty one is an error, never the working directory) as
    format `fmt` ("auto" detects it); `config` is a model config, or the path of one
    (`model_config.load_config_file`), for sources that carry none or to override theirs (the
    returned `config`); `files` are the model files that travel with it (`model_config.model_files_of`,
    those skipped in `notes`); `step` picks a step of a source that holds several (default: the format's:
    the latest, or the one its tracker names), a FormatError listing the steps there when it is
    not one of them; our checkpoint's reads are checked against the CRC-32s of its import unless
    `verify_reads=False` (a ConfigError for any other format: it records no CRC-32s). An optimizer state its reader found keyed by parameter index is named
    by the format's `names` hook, in the order `param_order` gives (names, or a file of them) or
    the model's (`formats.index_naming`; `rules` is the user's rules file); `param_order` for a
    format whose optimizer is never keyed by index is a ConfigError. Its step, its optimizer's
    step and hyper-parameters come back typed (`checked_steps`)."""
    if not isinstance(path, str | os.PathLike) or os.fspath(path) == "":  # (`io.paths.given`'s check)
        raise CheckpointError("an empty path was given as the source: name a folder or file")
    path = os.path.abspath(local_path(path))  # a URL: its local view, data read by ranges
    cfg = config_arg(config)
    if fmt == "auto":
        fmt = detect(path)
    if not verify_reads and fmt != "orbax":  # a flag honoured or refused, never ignored
        why = (f"{path} is a {fmt} checkpoint: only ours (Orbax, written by an import) records the CRC-32s "
               "a read is checked against, so there is no check to turn off")
        raise ConfigError(f"verify_reads=False: {why}", cli=f"--no-verify-reads: {why}")
    if fmt == "orbax" and url_of(path):  # our store in a bucket: complete, or refused before a read
        store_view(url_of(path))
    mod = reading(fmt).reader
    found = mod.steps(path) if step is not None and hasattr(mod, "steps") else None
    if fmt == "orbax":
        src = mod.open(path, config=cfg, step=step, verify_reads=verify_reads)
        if found is not None and found.folders:
            src = replace(src, notes=(found.note(step), *src.notes))
    elif found is not None:  # one step of several: its own folder, opened as the format opens it
        src = mod.open(found.folder(step), config=cfg)
        src = replace(src, notes=(found.note(step), *src.notes))
    else:
        src = mod.open(path, config=cfg)
        if step is not None and src.step != step:
            held = "no step number" if src.step is None else f"step {src.step}"
            raise FormatError(
                f"{path}: no step {step}: this {fmt} checkpoint holds one step ({held}); a step is picked "
                f"from a folder of several (step-N/, checkpoint-N/, iter_N/, global_stepN/, N/)"
            )
    reader = reading(fmt)
    if reader.names is not None:
        src = reader.call("names", src, cfg or src.config, param_order, rules=rules)
    elif param_order is not None and not getattr(param_order, "either_side", False):
        raise ConfigError(f"{_order_flag(param_order)}: {path} holds no optimizer state keyed by parameter "
                          f"index (the {fmt} reader names its optimizer itself): nothing to order")
    check_shapes(src)
    files, skipped = model_files_of(src, path, config)
    notes = tuple(displayed(n) for n in (*src.notes, *skipped))  # a file of a URL's view named by its URL
    return checked_steps(replace(src, config=cfg or src.config, files=files, notes=notes))


def _order_flag(param_order) -> str:
    """How a `param_order` was given, for a message (`--param-order FILE` or `param_order=`)."""
    if isinstance(param_order, str | os.PathLike):
        return f"--param-order {os.fspath(param_order)}"
    return "param_order="


def checked_steps(src: SourceCheckpoint) -> SourceCheckpoint:
    """`src` with its step and its optimizer's as ints and its optimizer's hyper-parameters
    typed (`optim.groups.checked_hyper`): a step read from a file (a list, a string, 2.5, inf) is
    a FormatError naming the source (`values.integer`), not a traceback later."""
    step = None if src.step is None else values.integer(src.step, src.path, "step")
    opt = src.optimizer
    if opt is not None:
        opt = dataclasses.replace(opt, hyper=checked_hyper(opt.hyper, src.path))
    if opt is not None and opt.step is not None:
        opt = dataclasses.replace(opt, step=values.integer(opt.step, src.path, "optimizer step"))
    return dataclasses.replace(src, step=step, optimizer=opt)


def check_shapes(src: SourceCheckpoint) -> None:
    """Every tensor of `src` (params, optimizer slots, masters) has a shape within the bounds of
    `lazy.shape_problem`: a FormatError naming the tensor otherwise, before anything plans on it."""
    groups = [("tensor", src.tensors)]
    if src.optimizer is not None:
        groups += [(f"{slot} of", t) for slot, t in src.optimizer.slots.items()]
        groups.append(("master weight", src.optimizer.master))
    good: dict[int, tuple] = {}  # id -> a shape tuple found good: views of one tensor share it
    for what, tensors in groups:  # (DeepSeek V3's 133,632 expert views: one tuple per grouped tensor)
        for name, t in tensors.items():
            shape = t.shape
            if type(shape) is tuple and good.get(id(shape)) is shape:
                continue  # this very tuple (immutable) was checked
            problem = shape_problem(tuple(shape))
            if type(shape) is tuple and problem is None:
                good[id(shape)] = shape
            if problem is not None:
                raise FormatError(f"{src.path}: {what} {short_repr(name)}: {problem}")
