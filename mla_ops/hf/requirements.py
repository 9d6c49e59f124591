"""The oldest transformers the HF integration runs on, checked once when mla_ops.hf is imported.

Older releases lay out the Cache base class differently (in 5.17 its max_batch_size is a
read-only property, so PagedMLACache cannot set it), and fail deep inside our classes; the
check turns that into one message that names the installed version and the fix.
pyproject.toml's `hf` and `test` extras pin the same minimum (a test keeps them equal).
"""
from __future__ import annotations

import re

MIN_TRANSFORMERS = (5, 23)


def check_transformers_version(version: str) -> None:
    """Raise ImportError if `version` (transformers.__version__) is older than MIN_TRANSFORMERS."""
    need = ".".join(map(str, MIN_TRANSFORMERS))
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ImportError(f"mla_ops.hf cannot read the transformers version {version!r}; it "
                          f"needs transformers >= {need}")
    if (int(m[1]), int(m[2])) < MIN_TRANSFORMERS:
        raise ImportError(f"mla_ops.hf needs transformers >= {need}, found {version}: "
                          f"pip install -U 'transformers>={need}'")
