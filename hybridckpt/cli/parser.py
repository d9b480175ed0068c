"""The argument parser of `hybridckpt`: every command, argument and option with its help text."""

from __future__ import annotations

import argparse

from hybridckpt.cli import commands
from hybridckpt.formats import registry

SRC_HELP = ("checkpoint folder or file of any supported format, or a hybridckpt (Orbax) checkpoint; or an "
            "object-storage URL (s3://bucket/prefix, any fsspec URL), read by byte ranges")
NO_VERIFY_HELP = ("read a hybridckpt (Orbax) source without checking each chunk against the CRC-32 recorded "
                  "at import (default: every read is checked; a damaged chunk is an error naming it)")
PLAN_HELP = ("print the import's plan and write nothing: per process and per device, the bytes to read, "
             "the reads, the files touched and the bytes to write, from metadata alone")


class _Parser(argparse.ArgumentParser):
    """argparse with the project's error form: one line on stderr, exit 2 (usage via --help)."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        import sys

        sys.stderr.write(f"hybridckpt: error: {' '.join(message.split())} (see {self.prog} --help)\n")
        raise SystemExit(2)


def _positive_number(text: str) -> float:
    """A finite number > 0 (NaN, inf, 0 and negatives refused)."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, found {text!r:.40}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number above 0, found {text!r:.40}")
    return value


def _thread_count(text: str) -> int:
    """A thread count between 1 and 256."""
    if not text.strip().isdigit() or not 1 <= int(text) <= 256:
        raise argparse.ArgumentTypeError(f"expected a whole number from 1 to 256, found {text!r:.40}")
    return int(text)


def _step(text: str) -> int:
    if not (text.strip().isascii() and text.strip().isdigit()) or len(text.strip()) > 18:
        raise argparse.ArgumentTypeError(f"expected a step number, found {text!r:.40}")
    return int(text)


def _atol(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, found {text!r:.40}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of at least 0, found {text!r:.40}")
    return value


def _common(sp, *, fmt=True, config=True, io=False, progress=True, step=True) -> None:
    if fmt:
        sp.add_argument("--format", default="auto", choices=["auto", *registry.NAMES],
                        help="source format (default: detect)")
    if step:
        sp.add_argument("--step", type=_step, help="the step to read of a folder of several: ours (N/), torchtitan "
                        "step-N/, Trainer checkpoint-N/, Megatron iter_N/, DeepSpeed global_stepN/, MaxText N/ "
                        "(default: the latest, or the one the tracker file names); an absent step is an error")
    if io:
        sp.add_argument("--io-threads", type=_thread_count, metavar="N",
                        help="parallel byte-range readers (default: $HYBRIDCKPT_IO_THREADS, else 2 x cores, 4..16); "
                             "an import writes its chunks with N + 2 writer threads")
    if config:
        sp.add_argument("--config", help="HF config.json or Meta params.json (or a folder holding one), for sources that carry no model config")
        sp.add_argument("--param-order", metavar="FILE",
                        help="an optimizer state keyed by parameter index (HF Trainer optimizer.pt, accelerate "
                        "optimizer.bin, torch.save of opt.state_dict()): its parameter names in index order, one a "
                        "line (default: the model's named_parameters() order, grouped as the writing tool does)")
    if progress:
        sp.add_argument("--quiet", action="store_true", help="no progress bar")


def _profile(sp) -> None:
    sp.add_argument("--profile", action="store_true",
                    help="account for the time: print seconds, bytes and MB/s per stage (open, plan, read, cut, "
                    "checksum, write, sync, metadata) and per worker thread, summing to the wall time")


def _plan_processes(sp) -> None:
    sp.add_argument("--processes", type=_thread_count, metavar="N",
                    help="with --plan: split the devices over N processes in order, as N hosts of a "
                    "jax.distributed run hold them (default: this run's processes)")
    sp.add_argument("--process", type=int, metavar="P",
                    help="with --plan: plan only process P (e.g. one host of --processes N)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="hybridckpt",
        description="Move training checkpoints (weights and optimizer state) between parallel layouts "
        "and frameworks as sharded JAX arrays.",
    )
    from hybridckpt import __version__

    p.add_argument("--version", action="version", version=f"hybridckpt {__version__}")
    p.add_argument("--debug", action="store_true", help="show the traceback of errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    s = sub.add_parser("inspect", help="format, topology, step, config and tensors of a checkpoint (reads metadata only)")
    s.add_argument("src", help=SRC_HELP)
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--plan", action="store_true", help=PLAN_HELP + " (with --mesh)")
    s.add_argument("--mesh", help="with --plan: the target mesh, e.g. fsdp=2,tp=2")
    _plan_processes(s)
    _common(s, progress=False)
    s.set_defaults(fn=commands.cmd_inspect)

    s = sub.add_parser(
        "import", help="any supported checkpoint -> Orbax checkpoint on a mesh",
        description=(
            "Import SRC (weights and optimizer state) into an Orbax checkpoint at DST, sharded on --mesh, "
            "streamed tile by tile in bounded memory. With a model config (in SRC or --config) the "
            "model's Flax tree is stored; without one, SRC's tensors under their own names, each "
            "sharded by the generic rule (fsdp on its largest divisible dim, then tp)."
        ),
    )
    s.add_argument("src", help=SRC_HELP)
    s.add_argument("dst", help="Orbax checkpoint directory to create")
    s.add_argument("--mesh", default="dp=1", help="target mesh, e.g. dp=1,fsdp=2,tp=2,pp=2 (default: one device)")
    s.add_argument("--params-only", action="store_true", help="do not import optimizer state")
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="cast the floating params, saying what was cast (default: each tensor as stored)")
    s.add_argument("--rules", help="a rules file applied before the format's own rules (model variants)")
    s.add_argument("--strict-sharding", action="store_true",
                   help="fail on a dimension the mesh cannot divide (default: replicate it on that axis, with a note)")
    s.add_argument("--replicate-indivisible", action="store_true", help=argparse.SUPPRESS)  # the default now
    s.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    s.add_argument("--compression", default="none", metavar="CODEC",
                   help="codec of the stored arrays: none (default: raw chunks, a file each, written at the disk's "
                   "speed and exported file to file), zstd (Orbax's default, level 1; about 21%% smaller bf16, 7%% "
                   "smaller fp32, several times slower on few cores) or zstd:LEVEL (1-22)")
    s.add_argument("--buffered-writes", action="store_true",
                   help="write raw chunk files through the page cache (default: O_DIRECT for chunks of whole "
                   "4 KiB blocks where the filesystem allows it: no copy into the page cache, which also "
                   "leaves what the machine has cached alone)")
    s.add_argument("--no-verify-reads", action="store_true", help=NO_VERIFY_HELP)
    s.add_argument("--plan", action="store_true", help=PLAN_HELP + "; DST is not touched")
    s.add_argument("--json", action="store_true", help="print the plan (with --plan), else the import's summary "
                   "with its account of the time (profile), as JSON")
    _profile(s)
    _plan_processes(s)
    _common(s, io=True)
    s.set_defaults(fn=commands.cmd_import)

    s = sub.add_parser(
        "export", help="Orbax or any supported checkpoint -> one single-card safetensors folder",
        description=(
            "Write SRC as one single-card checkpoint at OUT, tensor by tensor (the job of torch's "
            "dcp_to_torch_save and DeepSpeed's zero_to_fp32): with a model config, the model's "
            "tensors under Hugging Face names and config.json; without one, every tensor under "
            "SRC's own names. Tensors whose bytes are stored in order (FSDP2 and ZeRO shards, dim-0 "
            "splits) are copied as they are, never materialised; the rest are read and written one at "
            "a time. Files are written with O_DIRECT through two 8 MiB buffers (--buffered-writes: "
            "through the page cache). OUT appears complete (fsync'd, renamed into place) or not at all."
        ),
    )
    s.add_argument("src", help=SRC_HELP)
    s.add_argument("out", help="folder to create (model*.safetensors, config.json, optimizer*.safetensors)")
    s.add_argument("--optimizer", action="store_true",
                   help="also write optimizer*.safetensors (<name>.<slot>, e.g. exp_avg / exp_avg_sq, and step)")
    s.add_argument("--optimizer-layout", choices=["safetensors", "trainer"], default=None,
                   help="with --optimizer and --to hf: safetensors (default: optimizer*.safetensors) or trainer: the "
                   "HF Trainer's optimizer.pt (AdamW keyed by index, its decay / no-decay groups), scheduler.pt and "
                   "trainer_state.json, so Trainer.train(resume_from_checkpoint=OUT) resumes with the moments")
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="cast the floating params on write, saying what was cast (default: each tensor as stored)")
    s.add_argument("--rules", help="a rules file applied before the format's own rules")
    s.add_argument("--max-shard-gb", type=_positive_number, metavar="G",
                   help="shard size in GiB above which files are split (default 5)")
    s.add_argument("--no-verify-reads", action="store_true", help=NO_VERIFY_HELP)
    s.add_argument("--to", default="hf", choices=list(registry.TO_NAMES),
                   help="the format of OUT: " + "; ".join(f"{t}: {f.about}" for t, f in registry.WRITABLE.items()))
    s.add_argument("--writers", type=int, metavar="N", help=f"--to {registry.takers('files')}: how many "
                   "__R_0.distcp files (as N ranks write them; default 1)")
    s.add_argument("--tp", type=int, metavar="N", help=f"--to {registry.takers('tp')}: the tensor-parallel size "
                   "the chunks and files follow (default 1; Megatron reshards on load)")
    s.add_argument("--pp", type=int, metavar="M", help=f"--to {registry.takers('pp')}: the pipeline-parallel size (default 1)")
    s.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                   help=f"--to {registry.takers('scan_layers')}: layers stacked on MaxText's scan axis (scan_layers=true, "
                   "default) or one decoder.layers_<i> per layer (--no-scan-layers)")
    s.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    s.add_argument("--buffered-writes", action="store_true",
                   help="write the safetensors files through the page cache, stored runs copied file to file by "
                   "the kernel (default: O_DIRECT where the filesystem allows it: no copy into the page cache)")
    s.add_argument("--json", action="store_true",
                   help="print the export's summary with its account of the time (profile) as JSON")
    _profile(s)
    _common(s, io=True)
    s.set_defaults(fn=commands.cmd_export)

    s = sub.add_parser(
        "verify",
        help="compare two checkpoints tensor by tensor (HF names), or re-check an imported Orbax "
        "checkpoint against its recorded checksums (one argument); exit 1 on mismatch",
    )
    s.add_argument("a", help="a checkpoint of any supported format (alone: a hybridckpt checkpoint to re-check)")
    s.add_argument("b", nargs="?", help="the second checkpoint (omit to check A's checksums)")
    s.add_argument("--atol", type=_atol, default=0.0, help="allowed max abs difference (default 0: bitwise)")
    s.add_argument("--params-only", action="store_true",
                   help="compare the params alone (default: also every optimizer slot, the step and trainer state)")
    s.add_argument("--no-verify-reads", action="store_true", help=NO_VERIFY_HELP)
    _common(s, fmt=False)
    s.set_defaults(fn=commands.cmd_verify)

    s = sub.add_parser("logits", help="run the model's forward pass on tokens")
    s.add_argument("src", help=SRC_HELP)
    s.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 1,2,3")
    s.add_argument("--out", help="write the logits in .npy format to exactly this file (its folder must exist)")
    s.add_argument("--mesh", default="dp=1", help="mesh to run on, e.g. tp=2,pp=2 (default: one device)")
    s.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of activations and matmuls (params stay fp32; logits are fp32)")
    s.add_argument("--no-verify-reads", action="store_true", help=NO_VERIFY_HELP)
    _common(s, progress=False)
    s.set_defaults(fn=commands.cmd_logits)

    s = sub.add_parser("demo", help="import, reshard, export and verify a built-in sample (no other install needed)")
    s.add_argument("--workdir", help="write into this folder and keep it (its orbax/ and exported/ are replaced; "
                   "default: a temporary folder, deleted when the demo ends)")
    s.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    s.set_defaults(fn=commands.cmd_demo)
    for command in sub.choices.values():  # `hybridckpt import ... --debug` too (the top-level default kept)
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show the traceback of errors")
    return p
