"""Checkpoints in object storage: `s3://`, `gs://` and any other fsspec URL as SRC or DST.

`urls` tells a URL from a local path and opens its fsspec filesystem, importing fsspec and the
backend (s3fs, gcsfs) only when a URL asks for one. What reads a source from a bucket and what
writes a destination to one build on it.
"""
