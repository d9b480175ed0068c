"""The public `hybridckpt.restore`: one of our checkpoints onto any mesh (`store.restore`), once the
path is known to be one. An absent folder is one error and nothing is created (the store would
create it, as a training loop's store does); another format's checkpoint (an HF folder, DCP, ...)
is named as such, with the import that makes it one of ours (`readers.require_store`)."""

from __future__ import annotations

import functools
import os

from hybridckpt.readers import require_store
from hybridckpt.store.restore import restore as store_restore


@functools.wraps(store_restore)
def restore(directory, *args, **kwargs):
    require_store(os.fspath(directory))
    return store_restore(directory, *args, **kwargs)
