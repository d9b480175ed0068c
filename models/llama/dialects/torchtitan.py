"""torchtitan's Llama 3 (formats/dcp/torchtitan.py): every torchtitan checkpoint without another
family's marks; its names map by `torchtitan.rules`, wq/wk rows permuted from Meta's RoPE pairs."""

MARKERS: tuple[str, ...] = ()  # substrings some tensor name holds: none beyond torchtitan's own
NOTE = "wq/wk RoPE rows permuted"

# torchtitan 0.3 trains this family dense: `export --to torchtitan` writes it (formats/dcp/write_torchtitan.py)
EXPORTED = True
