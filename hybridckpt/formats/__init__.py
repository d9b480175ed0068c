"""Format readers: each module or package turns a folder or file of another framework into a
`SourceCheckpoint` (lazy tensors under the source's names, optimizer slots, topology, trainer
metadata): the parallel-layout mechanics of that framework (TP, PP, EP, ZeRO, buckets, offsets),
pure planning from metadata. Their registry, in detection order, is `hybridckpt.readers`.
"""
