"""Every checkpoint format, ours included: one package (or module) per format holding its layout
facts, its reader (a folder or file -> `SourceCheckpoint`: lazy tensors under the source's names,
optimizer slots, topology, trainer metadata; the parallel-layout mechanics of that framework: TP,
PP, EP, ZeRO, buckets, offsets; pure planning from metadata) and its writer when it has one. The
one registry of them all, in detection order, is `formats.registry`.
"""
