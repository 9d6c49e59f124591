"""A clear error, instead of silently missing gradients, when autograd reaches MLA attention.

mla::attention_with_output writes into a preallocated output and has no backward: left
alone, autograd would treat the attention output as a constant, and a backward pass
through a converted model would run and leave q / kv (and every weight before them)
without their attention gradients. When grad is enabled and an input of the attention
needs it, the layer passes its output through

    mla::no_backward(Tensor out, Tensor[] inputs) -> Tensor        (a copy of out)

whose backward calls mla::no_backward_error, an op that raises when it runs. Both are
custom ops with fake implementations, so torch.compile traces the forward and the
backward graphs; the error comes when a backward pass actually reaches the attention,
eager or compiled. With grad disabled (inference) nothing is added to the graph.
"""
from __future__ import annotations

import torch

MESSAGE = ("MLA attention (mla::attention_with_output) has no backward: gradients cannot "
           "flow through it. For inference run the model under torch.no_grad() or "
           "torch.inference_mode(); to train, use the unconverted model.")


@torch.library.custom_op("mla::no_backward_error", mutates_args=())
def no_backward_error(grad: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    raise RuntimeError(MESSAGE)


@no_backward_error.register_fake
def _(grad, inputs):
    return [torch.empty_like(t) for t in inputs]


@torch.library.custom_op("mla::no_backward", mutates_args=())
def no_backward(out: torch.Tensor, inputs: list[torch.Tensor]) -> torch.Tensor:
    return out.clone()


@no_backward.register_fake
def _(out, inputs):
    return torch.empty_like(out)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[1])


def _backward(ctx, grad):
    return None, torch.ops.mla.no_backward_error(grad, list(ctx.saved_tensors))


no_backward.register_autograd(_backward, setup_context=_setup)


def guard(out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """out, made to raise MESSAGE if a backward pass reaches it (a no-op without grad)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return torch.ops.mla.no_backward(out, list(inputs))
    return out
