"""A family owns its dialects (`models/<family>/dialects/`, `models.dialect`): the formats name no
family, every dialect file is read through the registry, the files ship in a wheel, and a new
family is one folder, Megatron checkpoints included."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest
from fixtures.megatron_writer import make_llama, write_megatron

from hybridckpt import models

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# every dialect a format asks for (formats/<format>: its `DIALECT`), and the parts they read
DIALECTS = {
    "megatron": ("",),
    "torchtitan": ("",),
    "paddlenlp": ("", "tp"),
    "meta": ("",),
    "flex_checkpoint": ("",),
    "maxtext": ("",),
}


def _python(code: str, cwd: str = REPO, path: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": path} if path else dict(os.environ)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


# -- the formats name no family ---------------------------------------------------------------


def family_literals(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, text) of every string literal in `source` (docstrings aside) equal to one of
    `names`: a family's name or one of its HF architectures."""
    tree = ast.parse(source)
    docs = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    return [
        (n.lineno, n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant)
        and isinstance(n.value, str)
        and id(n) not in docs
        and n.value in names
    ]


def _family_names() -> set[str]:
    fams = models.families().values()
    return {f.name for f in fams} | {a for f in fams for a in f.hf_architectures}


# what formats/megatron/config.py held before the dialects (in part): the scan must see it
BEFORE = """
FAMILY_RULES = {
    "llama": FamilyRules("megatron_llama.rules"),
    "qwen3": FamilyRules("megatron_qwen3.rules"),
}
ARCHITECTURES = (Architecture("MixtralForCausalLM", "Mixtral", moe=True),)
"""


def test_no_format_names_a_family():
    """No string in hybridckpt/ outside `models` is a family's name or HF architecture: what a
    format knows of a family it asks the registry. (Before the dialects the same scan finds
    them in formats/megatron/config.py, formats/dcp/torchtitan.py, formats/meta_llama.py and
    formats/paddle/rules.py; `BEFORE` is a piece of the first.)"""
    names = _family_names()
    found = []
    for root, _, files in os.walk(os.path.join(REPO, "hybridckpt")):
        if "models" in root.split(os.sep):
            continue
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                for line, text in family_literals(open(path, encoding="utf-8").read(), names):
                    found.append(f"{os.path.relpath(path, REPO)}:{line} {text!r}")
    assert not found, found
    assert {t for _, t in family_literals(BEFORE, names)} == {
        "llama",
        "qwen3",
        "MixtralForCausalLM",
    }


# -- every dialect is read through the registry -----------------------------------------------


def test_every_dialect_file_is_a_dialect_a_format_reads():
    """A family's dialects/ folder holds only `<dialect>.py`, `<dialect>.rules` and
    `<dialect>_<part>.rules` of dialects some format asks for, and each resolves (a `RULES`
    reference to another family's file included)."""
    seen = {}
    for fam in models.families().values():
        folder = os.path.join(REPO, "models", fam.name, "dialects")
        files = (
            sorted(f for f in os.listdir(folder) if f != "__pycache__")
            if os.path.isdir(folder)
            else []
        )
        for f in files:
            stem = f.removesuffix(".py").removesuffix(".rules")
            ok = f == "__init__.py" or any(
                stem == f"{d}{'_' + p if p else ''}" for d, parts in DIALECTS.items() for p in parts
            )
            assert ok, f"models/{fam.name}/dialects/{f}: no format reads it"
        for name, parts in DIALECTS.items():
            d = fam.dialect(name)
            if d is None:
                continue
            for part in parts:
                text, origin = d.rules(part)
                assert "->" in text or part == "tp", origin
                seen.setdefault(name, set()).add(fam.name)
    assert seen["megatron"] >= {
        "llama",
        "gpt2",
        "qwen2",
        "qwen3",
        "mixtral",
        "qwen3_moe",
        "deepseek_v3",
    }
    assert seen["torchtitan"] == {"llama", "qwen3", "qwen3_moe", "deepseek_v3"}
    assert seen["paddlenlp"] == {"llama", "mistral", "qwen2", "qwen3"}
    assert seen["meta"] == {"llama", "mistral", "mixtral"}
    assert models.family_named("gemma2").dialect("megatron") is None


def test_a_dialect_reference_that_resolves_nowhere_is_one_error(tmp_path):
    """A `RULES` naming a file that does not exist: one ConfigError naming the dialect."""
    from types import ModuleType

    spec = ModuleType("x")
    spec.RULES = "hybridckpt.models.llama.dialects:nope.rules"
    d = models.Dialect("llama", "megatron", "hybridckpt.models.llama.dialects", spec)
    with pytest.raises(models.errors.ConfigError, match="megatron: rules .*nope.rules"):
        d.rules()


# -- the dialect files ship in a wheel ---------------------------------------------------------


def test_dialect_files_ship_in_the_wheel(tmp_path):
    """`pip wheel . --no-deps` of a copy of the sources holds every family's dialect files, and
    the unpacked wheel, imported from a folder far from the checkout, reads them (and every
    family's HF rules, generated from its param table) through the registry."""
    src = tmp_path / "src"
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, f), src / f)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(os.path.join(REPO, "models"), src / "models", ignore=ignore)
    shutil.copytree(
        os.path.join(REPO, "hybridckpt"), src / "hybridckpt", symlinks=True, ignore=ignore
    )
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(tmp_path / "dist")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").iterdir()
    names = set(zipfile.ZipFile(wheel).namelist())
    repo_files = {
        f"hybridckpt/models/{fam}/dialects/{f}"
        for fam in os.listdir(os.path.join(REPO, "models"))
        if os.path.isdir(os.path.join(REPO, "models", fam, "dialects"))
        for f in os.listdir(os.path.join(REPO, "models", fam, "dialects"))
        if f.endswith((".rules", ".py"))
    }
    assert "hybridckpt/models/llama/dialects/megatron.rules" in repo_files
    assert repo_files <= names, sorted(repo_files - names)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    r = _python(
        """
        import hybridckpt
        from hybridckpt import models
        assert hybridckpt.__file__.startswith(SITE), hybridckpt.__file__
        n = 0
        for fam in models.families().values():
            assert "->" in fam.hf_rules()[0]
            for name in ("megatron", "torchtitan", "paddlenlp", "meta", "flex_checkpoint"):
                d = fam.dialect(name)
                if d is not None:
                    assert "->" in d.rules()[0]
                    n += 1
        print(n)
        """.replace("SITE", repr(str(site))),
        cwd=str(tmp_path),
        path=str(site),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.strip()) >= 20


# -- a new family is one folder: a toy family's Megatron checkpoint ----------------------------

# A Llama without positional encoding ("NoPE": Megatron's `--position-embedding-type none`), which
# no family of the tree describes; everything it needs for Megatron is in its folder.
TOY_INIT = '''
"""NoPE: Llama's blocks without any positional encoding (a toy family of the tests)."""

from dataclasses import dataclass

from hybridckpt.models.family import Family
from hybridckpt.models.llama.params import TABLE as LLAMA_TABLE

ARCHITECTURE = "NopeForCausalLM"


@dataclass(frozen=True)
class NopeConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float = 1e-6

    @property
    def family(self):
        return "nope"

    @property
    def head_dim(self):
        return self.hidden_size // self.num_heads


def from_hf(d, source):
    return NopeConfig(d["vocab_size"], d["hidden_size"], d["intermediate_size"],
                      d["num_hidden_layers"], d["num_attention_heads"],
                      d["num_key_value_heads"], d.get("rms_norm_eps", 1e-6))


def to_hf(cfg):
    return {"architectures": [ARCHITECTURE], "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "rms_norm_eps": cfg.rms_norm_eps}


def rule_variables(cfg):
    return dict(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                num_layers=cfg.num_layers, intermediate_size=cfg.intermediate_size, tied=False)


FAMILY = Family(
    name="nope", config_cls=NopeConfig, hf_architectures=(ARCHITECTURE,),
    hf_model_types=("nope",), config_from_hf=from_hf, config_to_hf=to_hf,
    table=LLAMA_TABLE, rule_variables=rule_variables,  # Llama's params, declared once there
    module="hybridckpt.models.nope.module:Nope",
)
'''
TOY_MEGATRON = '''
"""Megatron-LM's NoPE: Llama's layout with `--position-embedding-type none`."""

DESCRIPTION = "NoPE"
MATCH = {"normalization": "RMSNorm", "swiglu": True, "position_embedding": "none",
         "qkv_bias": False, "qk_layernorm": False}
HF_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size",
           "ffn_hidden_size": "intermediate_size", "num_layers": "num_hidden_layers",
           "num_heads": "num_attention_heads", "num_query_groups": "num_key_value_heads",
           "norm_eps": "rms_norm_eps"}
'''
TOY_MEGATRON_RULES = """
embedding.word_embeddings.weight -> model.embed_tokens.weight : trim(0, {vocab_size}, {padded_vocab})
decoder.layers.$L.self_attention.linear_qkv.layer_norm_weight -> model.layers.$L.input_layernorm.weight
decoder.layers.$L.self_attention.linear_qkv.weight -> model.layers.$L.self_attn.q_proj.weight, model.layers.$L.self_attn.k_proj.weight, model.layers.$L.self_attn.v_proj.weight : fused_qkv(0, {num_heads}, {num_kv_heads})
decoder.layers.$L.self_attention.linear_proj.weight -> model.layers.$L.self_attn.o_proj.weight
decoder.layers.$L.mlp.linear_fc1.layer_norm_weight -> model.layers.$L.post_attention_layernorm.weight
decoder.layers.$L.mlp.linear_fc1.weight -> model.layers.$L.mlp.gate_proj.weight, model.layers.$L.mlp.up_proj.weight : split(0, 2)
decoder.layers.$L.mlp.linear_fc2.weight -> model.layers.$L.mlp.down_proj.weight
decoder.final_layernorm.weight -> model.norm.weight
output_layer.weight -> lm_head.weight : trim(0, {vocab_size}, {padded_vocab})
"""


def _write_toy(folder) -> None:
    """The toy family's one folder: `__init__.py` (its params: Llama's table), `dialects/megatron.{py,rules}`."""
    (folder / "dialects").mkdir(parents=True)
    (folder / "__init__.py").write_text(TOY_INIT)
    (folder / "dialects" / "__init__.py").write_text('"""The NoPE family\'s dialects."""\n')
    (folder / "dialects" / "megatron.py").write_text(TOY_MEGATRON)
    (folder / "dialects" / "megatron.rules").write_text(TOY_MEGATRON_RULES)


def test_a_new_family_in_its_own_folder_reads_megatron(tmp_path):
    """A toy family (a Llama without positional encoding) whose folder, outside the tree on
    `models.__path__`, holds its megatron dialect: a Megatron checkpoint of it (tp 2, pp 2,
    Adam moments) opens under its HF names bit for bit and imports into its params tree, with
    nothing outside that folder changed. Without the folder the same checkpoint is refused."""
    ref = make_llama(hidden=32, layers=4, heads=4, kv_heads=2, ffn=48, vocab=100, seed=3)
    root = str(tmp_path / "megatron")
    write_megatron(
        root, ref, tp=2, pp=2,
        args={"position_embedding_type": "none", "use_rotary_position_embeddings": False},
    )  # fmt: skip
    np.savez(tmp_path / "ref.npz", **{f"w/{k}": v for k, v in ref.weights.items()},
             **{f"m/{k}": v for k, v in ref.exp_avg.items()})  # fmt: skip
    _write_toy(tmp_path / "families" / "nope")
    check = f"""
        import os
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
        import numpy as np
        import hybridckpt
        from hybridckpt import models
        from hybridckpt.errors import FormatError

        if {{toy}}:
            models.__path__.append({str(tmp_path / "families")!r})
        try:
            opened = hybridckpt.open_checkpoint({root!r})
        except FormatError as e:
            print("refused:", e)
            raise SystemExit(0)
        assert type(opened.config).__name__ == "NopeConfig", opened.config
        ref = np.load({str(tmp_path / "ref.npz")!r})
        w = {{k[2:]: ref[k] for k in ref.files if k.startswith("w/")}}
        m = {{k[2:]: ref[k] for k in ref.files if k.startswith("m/")}}
        params = opened.named.params
        assert set(params) == set(w), sorted(set(params) ^ set(w))
        for k in w:
            assert np.array_equal(params[k].materialize(), w[k]), k
            assert np.array_equal(opened.named.slots["exp_avg"][k].materialize(), m[k]), k
        hybridckpt.import_checkpoint({root!r}, {str(tmp_path / "store")!r}, mesh="dp=1")
        cfg, restored = hybridckpt.restore({str(tmp_path / "store")!r}, "dp=1")
        q = np.asarray(restored.params["layers"]["q"]["kernel"])
        for i in range(cfg.num_layers):
            assert np.array_equal(q[i], w[f"model.layers.{{i}}.self_attn.q_proj.weight"].T), i
        print("imported", cfg)
        """
    without = _python(check.replace("{toy}", "False"), cwd=str(tmp_path))
    assert without.returncode == 0, without.stderr[-3000:]
    assert "refused:" in without.stdout and "position_embedding_type=none" in without.stdout
    with_toy = _python(check.replace("{toy}", "True"), cwd=str(tmp_path))
    assert with_toy.returncode == 0, with_toy.stderr[-3000:]
    assert with_toy.stdout.startswith("imported NopeConfig"), with_toy.stdout
