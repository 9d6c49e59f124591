import os

import torch

# Triton kernels run on the CPU through the interpreter; set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture
def flashmla_at_every_size(monkeypatch):
    """backend="auto" takes FlashMLA wherever it serves, also for the few heads and short
    caches of the tiny test models (where lowering.flashmla_pays would give the call to
    the Triton kernel)."""
    from lowering.decode import registry
    monkeypatch.setattr(registry, "SMALL_DECODE_POSITIONS", 0)
