"""The front door (issue 28): what got in the way of a new user trying the README, the CLI and the
library on their own checkpoints, each pinned by a test that runs the command as a user would and
fails on the old behaviour. Where the process is the point (`python -m hybridckpt`, `--version`,
`--debug`'s traceback, no XLA_FLAGS of ours: the CLI's own 8 devices, a JAX backend that cannot
start, a restore in a fresh interpreter, the demo on its 8 devices) the command runs in a subprocess; elsewhere the CLI's
`main` runs in this process (`cli`: the same exit code, stdout and stderr, without a fresh
interpreter's ~2 CPU-s per command).

The export checks load what we wrote with `transformers` itself (model, GenerationConfig,
tokenizer) and generate with it, against the same calls on the source folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from importlib.util import find_spec

import numpy as np
import pytest
from meshes import fit
from real.cases import ckpt

from hybridckpt.cli import main
from hybridckpt.demo import sample_path
from hybridckpt.io.byte_source import close_all

CLI = [sys.executable, "-m", "hybridckpt"]
TOKENS = {"bos_token_id": 64, "eos_token_id": 65, "pad_token_id": 66}


def user_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: none of the test session's JAX settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    if os.environ.get("HYBRIDCKPT_TEST_PLATFORM", "cpu") == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    return env | extra


def run(*args: str, cwd=None, env=None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env=env or user_env())


def ok(*args: str, **kw) -> str:
    r = run(*args, **kw)
    assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stdout, r.stderr)
    return r.stdout


@dataclass(frozen=True)
class Ran:
    """What a user sees of one command run in this process: exit code, stdout, stderr."""

    returncode: int
    stdout: str
    stderr: str


class InProcess:
    """The CLI's `main` in this process, its output captured by `capsys`."""

    def __init__(self, capsys) -> None:
        self.capsys = capsys

    def run(self, *args: str) -> Ran:
        self.capsys.readouterr()
        try:
            code = main([str(a) for a in args])
        finally:
            close_all()
        out = self.capsys.readouterr()
        return Ran(code, out.out, out.err)

    def ok(self, *args: str) -> str:
        r = self.run(*args)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stdout, r.stderr)
        return r.stdout


@pytest.fixture
def cli(capsys) -> InProcess:
    return InProcess(capsys)


def one_line_error(r) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr[-2000:])
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("hybridckpt: error: "), r.stderr
    return r.stderr


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A checkpoint as transformers 5 saves it (config.json with `rope_parameters`, the token ids
    and `dtype`; generation_config.json) plus a tokenizer saved by tokenizers/transformers."""
    transformers = pytest.importorskip("transformers")
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    out = tmp_path_factory.mktemp("hf") / "llama"
    vocab = {f"t{i}": i for i in range(64)} | {"<s>": 64, "</s>": 65, "<pad>": 66, "<unk>": 67}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", unk_token="<unk>")
    cfg = transformers.LlamaConfig(vocab_size=68, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   **TOKENS)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.generation_config = transformers.GenerationConfig(max_new_tokens=6, do_sample=False, **TOKENS)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    written = json.loads((out / "config.json").read_text())
    assert "rope_parameters" in written and "rope_theta" not in written and written["eos_token_id"] == 65
    return out


def generate(folder) -> tuple[list[int], np.ndarray, object]:
    """What transformers makes of a folder: greedy tokens, logits of the prompt, its dtype."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    gen = transformers.GenerationConfig.from_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tok("t1 t7 t3", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits.float().numpy()
    return model.generate(ids, generation_config=gen).tolist()[0], logits, model.dtype


# -- exports a user can generate with ------------------------------------------------------------


def test_an_export_of_our_store_loads_and_generates_in_transformers_as_the_source(hf_llama, tmp_path, cli):
    out = cli.ok("import", str(hf_llama), str(tmp_path / "ck"), "--mesh", fit("fsdp=2,tp=2"), "--quiet")
    assert "matched nothing" not in out  # (the family's own rules are not the user's business)
    ins = json.loads(cli.ok("inspect", str(tmp_path / "ck"), "--json"))
    assert ins["files"] == ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    cli.ok("export", str(tmp_path / "ck"), str(tmp_path / "out"), "--quiet")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (hf_llama / name).read_bytes(), name  # as they were
    want, got = generate(hf_llama), generate(tmp_path / "out")
    assert got[0] == want[0] and np.array_equal(got[1], want[1]) and got[2] == want[2]
    # a cast export says its dtype; nothing else of the config changes
    cli.ok("export", str(tmp_path / "ck"), str(tmp_path / "bf16"), "--dtype", "bfloat16", "--quiet")
    cast = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert cast == json.loads((hf_llama / "config.json").read_text()) | {"dtype": "bfloat16"}
    tokens, _, dtype = generate(tmp_path / "bf16")
    assert str(dtype) == "torch.bfloat16" and len(tokens) > 3


def test_a_source_without_an_hf_config_exports_one_with_a_generation_config(tmp_path, cli):
    """Meta's Llama 3.1 (the real tool's files): config.json is the family's, RoPE scaling in both
    transformers spellings, and a generation_config.json is written so GenerationConfig loads."""
    transformers = pytest.importorskip("transformers")
    cli.ok("import", ckpt("meta_llama31_mp1"), str(tmp_path / "ck"), "--quiet")
    cli.ok("export", str(tmp_path / "ck"), str(tmp_path / "out"), "--quiet")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] in ("float32", "bfloat16") and config["rope_scaling"]["rope_type"] == "llama3"
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == {"_from_model_config": True}
    transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.rope_parameters["rope_type"] == "llama3"


def test_a_config_given_with_config_travels_with_its_tokenizer(hf_llama, tmp_path, cli):
    """A source with no config of its own (a model-agnostic safetensors file here) imported with
    --config: that config.json (token ids and all) and the files beside it reach the export."""
    from safetensors.numpy import load_file, save_file

    (tmp_path / "weights").mkdir()
    save_file(load_file(str(hf_llama / "model.safetensors")), str(tmp_path / "weights" / "model.safetensors"))
    (tmp_path / "weights" / "config.json").write_text("{}")  # a folder's own config.json, overridden
    cli.ok("import", str(tmp_path / "weights"), str(tmp_path / "ck"), "--config", str(hf_llama / "config.json"),
           "--format", "hf", "--quiet")
    cli.ok("export", str(tmp_path / "ck"), str(tmp_path / "out"), "--quiet")
    assert (tmp_path / "out" / "config.json").read_bytes() == (hf_llama / "config.json").read_bytes()
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (hf_llama / "tokenizer.json").read_bytes()


def test_a_family_hybridckpt_has_no_model_for_comes_back_as_transformers_saved_it(tmp_path, cli):
    """Phi (no family here): imported under its own names, exported with its own config.json and
    generation config; transformers' logits of the export equal the source's, bit for bit."""
    transformers = pytest.importorskip("transformers")
    import torch

    cfg = transformers.PhiConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.PhiForCausalLM(cfg).save_pretrained(tmp_path / "phi")
    out = cli.ok("import", str(tmp_path / "phi"), str(tmp_path / "ck"), "--mesh", fit("fsdp=2"))
    assert "PhiForCausalLM, which no model family implements" in out and "with its config.json" in out
    assert "pass --config" not in out
    cli.ok("export", str(tmp_path / "ck"), str(tmp_path / "out"), "--quiet")
    for name in ("config.json", "generation_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "phi" / name).read_bytes(), name
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        want, got = (transformers.AutoModelForCausalLM.from_pretrained(tmp_path / d)(ids).logits for d in ("phi", "out"))
    assert torch.equal(want, got)


def test_carried_files_are_data_checked_on_the_way_out(hf_llama, tmp_path, cli):
    """A stored file whose bytes changed, or a recorded name that is a path: one line, exit 2,
    nothing written."""
    cli.ok("import", str(hf_llama), str(tmp_path / "ck"), "--quiet")
    stored = tmp_path / "ck" / "0" / "hf_files" / "tokenizer.json"
    assert "12/12 arrays match their import checksums, 4/4 carried config and tokenizer files" in cli.ok("verify", str(tmp_path / "ck"))
    stored.write_bytes(stored.read_bytes().replace(b"t1", b"x1"))
    checked = cli.run("verify", str(tmp_path / "ck"))
    assert checked.returncode == 1 and "BAD hf_files/tokenizer.json: unreadable:" in checked.stdout
    assert "12/12 arrays match their import checksums, 3/4 carried config and tokenizer files" in checked.stdout
    err = one_line_error(cli.run("export", str(tmp_path / "ck"), str(tmp_path / "out")))
    assert "tokenizer.json: CRC-32" in err and not (tmp_path / "out").exists()
    state_file = tmp_path / "ck" / "0" / "trainer_state" / "metadata"
    state = json.loads(state_file.read_text())
    state["hf_files"]["../escape.json"] = state["hf_files"].pop("tokenizer.json")
    state_file.write_text(json.dumps(state))
    err = one_line_error(cli.run("export", str(tmp_path / "ck"), str(tmp_path / "out")))
    assert "'../escape.json' is not the plain name of a config or tokenizer file" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "escape.json").exists()


# -- package and CLI ------------------------------------------------------------------------------


def test_version_python_m_and_debug_after_the_subcommand(tmp_path):
    assert ok("--version").strip() == f"hybridckpt {metadata.version('hybridckpt')}"
    assert "inspect" in ok("--help")
    bad = run("inspect", str(tmp_path / "nothing"), "--debug")
    assert bad.returncode == 2 and "Traceback" in bad.stderr and "no such file or directory" in bad.stderr
    assert run("--debug", "inspect", str(tmp_path / "nothing")).stderr.startswith("Traceback")
    assert one_line_error(run("inspect", str(tmp_path / "nothing")))


@pytest.mark.parametrize("mesh, message", [
    ("ep=2,tp=2", "unknown axis 'ep'; the axes are dp, fsdp, tp, pp (expert parallelism is not an axis"),
    ("tp=16", "needs 16 devices but only 8 exist; on a CPU, simulate them: "
              "XLA_FLAGS=--xla_force_host_platform_device_count=16 hybridckpt"),
])
def test_mesh_mistakes_say_what_to_do(mesh, message, tmp_path):
    assert message in one_line_error(run("import", sample_path(), str(tmp_path / "x"), "--mesh", mesh))


def test_a_mesh_uses_the_first_devices_its_sizes_multiply_to_and_says_so(tmp_path):
    out = ok("import", sample_path(), str(tmp_path / "ck"), "--mesh", "fsdp=3,tp=2", "--quiet")
    assert "on mesh dp=1,fsdp=3,tp=2,pp=1 (6 of 8 devices;" in out


def test_a_backend_jax_cannot_start_is_one_line_with_the_install_hint(tmp_path):
    cuda_installed = any(find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_cuda12_pjrt"))
    platform = "tpu" if cuda_installed else "cuda"  # (one JAX cannot start here)
    err = one_line_error(run("import", sample_path(), str(tmp_path / "ck"), env=user_env(JAX_PLATFORMS=platform)))
    assert f"JAX cannot start the backend JAX_PLATFORMS='{platform}' asks for" in err
    assert ("pip install 'hybridckpt[cuda]'" if platform == "cuda" else "pip install 'jax[tpu]'") in err
    assert "unset JAX_PLATFORMS to run on the CPU" in err and not (tmp_path / "ck").exists()


def test_inspect_json_has_one_schema_for_every_format(tmp_path, cli):
    from hybridckpt.jobs.inspect import SCHEMA

    cli.ok("import", sample_path(), str(tmp_path / "ck"), "--quiet")
    meta = ckpt("meta_llama31_mp1")
    infos = {src: json.loads(cli.ok("inspect", src, "--json"))
             for src in (sample_path(), str(tmp_path / "ck"), meta, ckpt("megatron_lm_dense_torch"))}
    for src, info in infos.items():
        assert list(info) == list(SCHEMA) and info["schema"] == 1, src
        if info["optimizer"] is not None:
            assert sorted(info["optimizer"]) == ["hyper", "master_weights", "name", "param_groups", "params_with_state", "slots", "step"], src
    assert infos[sample_path()]["optimizer"]["slots"] == infos[str(tmp_path / "ck")]["optimizer"]["slots"]
    assert infos[meta]["config"]["rope_scaling"] == {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def test_already_exists_names_the_fix_in_the_callers_words(tmp_path, cli):
    from hybridckpt import import_checkpoint
    from hybridckpt.errors import CheckpointError

    cli.ok("import", sample_path(), str(tmp_path / "ck"), "--quiet")
    err = one_line_error(cli.run("import", sample_path(), str(tmp_path / "ck")))
    assert "exists and is not empty; pass --overwrite to replace it" in err and "overwrite=True" not in err
    with pytest.raises(CheckpointError) as e:
        import_checkpoint(sample_path(), str(tmp_path / "ck"))
    assert "exists and is not empty; pass overwrite=True to replace it" in str(e.value) and "--" not in str(e.value)


def test_a_users_rules_that_match_nothing_are_still_reported(tmp_path, cli):
    rules = tmp_path / "mine.rules"
    rules.write_text("model.* -> model.*\nlm_head.weight -> lm_head.weight\nbackbone.$L.weight -> _\n")
    out = cli.ok("import", sample_path(), str(tmp_path / "ck"), "--rules", str(rules), "--quiet")
    assert f"note: rule matched nothing: {rules}:3: backbone.$L.weight -> _" in out and "hf.rules" not in out


def test_restore_without_a_mesh_and_without_xla_flags(tmp_path, cli):
    cli.ok("import", sample_path(), str(tmp_path / "ck"), "--mesh", fit("fsdp=2,tp=2,pp=2"), "--quiet")
    script = """
import hybridckpt, jax
cfg, r = hybridckpt.restore("ck")
print(jax.device_count(), r.params["layers"]["q"]["kernel"].sharding.mesh.size, int(r.opt_state[0].count))
try:
    hybridckpt.restore("ck", "tp=2")
except hybridckpt.HybridCkptError as e:
    print(e)
"""
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                       env=user_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()[:2]
    assert first == "1 1 12"  # one CPU device: restored onto it
    assert ("needs 2 devices but only 1 exist; on a CPU, simulate them: os.environ['XLA_FLAGS'] = "
            "'--xla_force_host_platform_device_count=2' before JAX is imported") in second


def test_the_demo_says_its_folder_is_temporary_and_removes_it():
    out = ok("demo")  # (a subprocess: the demo's mesh is the CLI's own 8 devices)
    line = next(x for x in out.splitlines() if x.startswith("folder:"))
    folder = line.split()[1]
    assert "(temporary: deleted when the demo ends" in line and f"removed {folder}" in out
    assert not os.path.exists(folder) and "demo: OK" in out
