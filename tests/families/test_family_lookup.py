"""A job that needs one family imports that family's package, not all 27 (issue 42: importing every
family was about 0.1 s of CPU of an FSDP2 import's serial `open`). Each lookup runs in a fresh
process and counts the family packages (`hybridckpt.models.<folder>` defining `FAMILY`) it
imported; the answer must be the one full discovery gives."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from hybridckpt.models import family

CHILD = textwrap.dedent("""
    import json, pkgutil, sys
    import hybridckpt.models
    from hybridckpt.models import family, dialect
    def imported():
        return sorted(i.name for i in pkgutil.iter_modules(hybridckpt.models.__path__, "hybridckpt.models.")
                      if i.name in sys.modules and hasattr(sys.modules[i.name], "FAMILY"))
    out = {}
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256}
    fam = family.family_for_hf(cfg, "config.json")
    out["for_hf"] = [fam.name, imported()]
    c = fam.config_from_hf(cfg, "config.json")
    out["of"] = [family.family_of(c).name, imported()]
    out["torchtitan"] = [sorted(dialect.dialects("torchtitan")), imported()]
    print(json.dumps(out))
""")


def test_one_family_looked_up_imports_its_package_only():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, timeout=300)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    every = family.families()  # (this process: all of them, the full discovery)
    assert len(every) >= 20
    name, imported = got["for_hf"]
    assert name == "llama" and every["llama"].name == name
    # llama's package and what it imports itself (gpt2's shared pieces); before: all 27
    assert "hybridckpt.models.llama" in imported and len(imported) <= 2
    name, imported_after = got["of"]
    assert name == "llama" and imported_after == imported
    speaking, imported = got["torchtitan"]
    assert speaking == sorted(f for f in every if every[f].dialect("torchtitan") is not None)
    assert len(speaking) >= 2 and set(imported) <= {f"hybridckpt.models.{f}" for f in every} and len(imported) < len(every) // 2


def test_a_model_type_names_one_of_our_folders_or_nothing():
    """`model_type` is data from a file: it picks among the family folders, never an import path."""
    for bad in ("api", "family", "..", "llama.module", "os", None, 3):
        assert family._named_package(bad) is None
    assert family._named_package("llama") is family.families()["llama"]
    with_archs = {"architectures": ["Qwen3ForCausalLM"], "model_type": "llama"}  # the architectures decide, as before
    assert family.family_for_hf(with_archs, "c").name == family.families()["qwen3"].name
