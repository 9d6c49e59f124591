import os
import re

import torch

# Triton kernels run on the CPU through the interpreter; set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture
def flashmla_at_every_size(monkeypatch):
    """backend="auto" takes FlashMLA wherever it serves, also for the few heads and short
    caches of the tiny test models, and the few requests of 128-head ones (where
    lowering.flashmla_pays would give the call to the Triton or the Gluon pair kernel,
    and the registry's _few_rows_gluon to the Gluon few-rows kernel)."""
    from lowering.decode import registry
    monkeypatch.setattr(registry, "SMALL_DECODE_POSITIONS", 0)
    monkeypatch.setattr(registry, "FEW_REQUESTS", 0)
    monkeypatch.setattr(registry, "_few_rows_gluon", lambda call, auto: False)


# Tests that need a GPU: marked `gpu` explicitly, or skipped without CUDA by a skipif whose
# reason says so; `pytest -m gpu tests` runs just those on a GPU machine (the whole suite
# there also runs the CPU tests and the tests that take either device).
_NEEDS_GPU = re.compile(r"\bneeds? (a |two )?(CUDA|GPU)|runs on CUDA")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            continue
        if any(_NEEDS_GPU.search(str(m.kwargs.get("reason", "")))
               for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.gpu)
