"""The Granite family's params (`models.table`): exactly Llama's (`models.llama.params`), HF
GraniteForCausalLM names are LlamaForCausalLM's; the four Granite scalars are config, no params.
"""

from __future__ import annotations

from hybridckpt.models.llama.params import TABLE as LLAMA
from hybridckpt.models.table import ParamTable

TABLE = ParamTable(__name__, LLAMA.dims, LLAMA.rows, LLAMA.groups, named_parameters=LLAMA.named_parameters)
