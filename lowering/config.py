"""mla-ops settings: the one place where a user chooses how the kernels run.

In the style of ``torch._inductor.config``: module attributes, read where they are used
(so torch.compile guards on them and a change recompiles rather than silently keeping
the old choice). Each has a documented environment variable as its default.

A choice that changes a compiled graph is made in code Dynamo traces (the converted
modules' forwards), or at run time in an opaque op. The implementation of a triton op
(torch.library.triton_op) may read a setting only on a path such code has already
chosen: AOTAutograd traces those implementations, so Dynamo sets no guard on what they
read, and the compile caches (AOTAutograd's, Inductor's FX graph cache) do not key on it:
a setting decided there alone would be served from the cache of the other choice, across
processes too.

    import lowering.config as mla_config
    mla_config.validate = True                  # or MLA_VALIDATE=1
    with mla_config.patch(batch_invariant=True):
        ...

Settings
    validate (MLA_VALIDATE=1): run the value checks that need device data on the host
        (lengths, block ids and cache slots in range) before every eager call on a CUDA
        tensor. Off by default: each costs a device->host copy and a sync. Kernels bound
        their reads and writes either way, so a bad value can give wrong rows, never an
        out-of-bounds access. Value checks of CPU tensors always run (no sync there).
    batch_invariant (MLA_BATCH_INVARIANT=1): decode results that are bit-identical
        whatever else is in the batch (fixed-size splits merged in order, one config per
        head count; the Triton decode kernels provide it, so "auto" picks them).
    linear_impl (MLA_LINEAR_IMPL): "auto" runs the converted model's decode GEMMs on our
        Triton kernels where they serve; "torch" keeps the modules' own F.linear calls.
    head_gemm_impl (MLA_HEAD_GEMM_IMPL): "auto" | "torch", the same for the absorbed
        per-head GEMMs (q_nope @ W_UK_T, o_latent @ W_UV).
    quant_impl (MLA_QUANT_IMPL): "auto" (Triton quant kernels on CUDA), "torch" (the
        reference everywhere) or "triton" (the kernels on CPU too, under the interpreter).
"""
from __future__ import annotations

import contextlib
import os

_IMPLS = ("auto", "torch")


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "0")
    if value not in ("0", "1"):
        raise ValueError(f"environment variable {name} must be 0 or 1, got {value!r}")
    return value == "1"


def _env_choice(name: str, choices: tuple) -> str:
    value = os.environ.get(name, "auto")
    if value not in choices:
        raise ValueError(f"environment variable {name} must be one of {choices}, got {value!r}")
    return value


validate: bool = _env_flag("MLA_VALIDATE")
batch_invariant: bool = _env_flag("MLA_BATCH_INVARIANT")
linear_impl: str = _env_choice("MLA_LINEAR_IMPL", _IMPLS)
head_gemm_impl: str = _env_choice("MLA_HEAD_GEMM_IMPL", _IMPLS)
quant_impl: str = _env_choice("MLA_QUANT_IMPL", _IMPLS + ("triton",))

_CHOICES = {"validate": (False, True), "batch_invariant": (False, True),
            "linear_impl": _IMPLS, "head_gemm_impl": _IMPLS,
            "quant_impl": _IMPLS + ("triton",)}


def _check(name: str, value) -> None:
    if name not in _CHOICES:
        raise AttributeError(f"lowering.config has no setting {name!r}; settings: "
                             f"{sorted(_CHOICES)}")
    if value not in _CHOICES[name] or type(value) is not type(_CHOICES[name][0]):
        raise ValueError(f"lowering.config.{name} must be one of {_CHOICES[name]}, got {value!r}")


@contextlib.contextmanager
def patch(**settings):
    """Set some settings for the duration of a with-block, then restore them."""
    g = globals()
    for name, value in settings.items():
        _check(name, value)
    old = {name: g[name] for name in settings}
    g.update(settings)
    try:
        yield
    finally:
        g.update(old)


def current() -> dict:
    """The settings in force, name -> value (for benchmark records)."""
    g = globals()
    return {name: g[name] for name in _CHOICES}
