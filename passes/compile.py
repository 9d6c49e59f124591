"""Installing the passes per compile, never through global Inductor config.

    compile_with_passes(fn, *, fusion=None, dynamic=None, fullgraph=False, **pass_kwargs)
        torch.compile(fn) with options {post_grad_custom_post_pass: MLAFusionPass,
        enable_auto_functionalized_v2: ...}: the options are scoped to that compile.
    torch.compile(fn, backend="mla_inductor")
        the same through a registered backend (config.patch scoped to the compile call).
"""
from __future__ import annotations

import torch
from torch._dynamo import register_backend

from passes.manager import MLAFusionPass


def has_auto_functionalized_v2() -> bool:
    """Feature check: torch versions without the v2 HOP or its config flag use v1."""
    try:
        from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch._inductor.config, "enable_auto_functionalized_v2")


def inductor_options(fusion: MLAFusionPass) -> dict:
    opts = {"post_grad_custom_post_pass": fusion}
    if has_auto_functionalized_v2():
        opts["enable_auto_functionalized_v2"] = fusion.v2
    elif fusion.v2:
        raise RuntimeError("this torch has no auto_functionalized_v2; build MLAFusionPass(v2=False)")
    return opts


def compile_with_passes(fn, *, fusion: MLAFusionPass | None = None, dynamic=None,
                        fullgraph: bool = False, **pass_kwargs):
    """torch.compile `fn` with the MLA fusion passes; the pass object is `.fusion`."""
    fusion = fusion or MLAFusionPass(v2=pass_kwargs.pop("v2", has_auto_functionalized_v2()),
                                     **pass_kwargs)
    compiled = torch.compile(fn, dynamic=dynamic, fullgraph=fullgraph,
                             options=inductor_options(fusion))
    try:
        compiled.fusion = fusion
    except AttributeError:
        pass
    return compiled


@register_backend
def mla_inductor(gm, example_inputs, **kwargs):
    """torch.compile backend: Inductor with the default MLAFusionPass."""
    from torch._inductor.compile_fx import compile_fx
    fusion = MLAFusionPass(v2=has_auto_functionalized_v2())
    with torch._inductor.config.patch(inductor_options(fusion)):
        return compile_fx(gm, example_inputs)
