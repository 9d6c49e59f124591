"""An HF DeepSeek model with random weights turned into the FP8 checkpoint form (for the
benchmarks and a first try without a checkpoint): every linear (and the routed experts)
swapped for HF's FineGrainedFP8 modules, each weight quantized by HF's own Fp8Quantize in
128 x 128 blocks, as DeepSeek-V3 / R1 ship theirs. Nothing is downloaded.

A weight whose shape is not a multiple of the block (kv_a_proj_with_mqa's 576 rows) is
zero-padded to one before HF's quantizer sees it and cut back after (zeros leave each
block's amax as it is): the ceil-sized scale grid FP8 checkpoints store for such weights.
Each expert's gate and up halves are quantized apart, as a checkpoint stores gate_proj and
up_proj.
"""
from __future__ import annotations

import torch


def _quantize(weight: torch.Tensor, quantizer, block) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight [N, K], weight_scale_inv [ceil(N / bn), ceil(K / bk)] fp32)."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    bn, bk = block
    N, K = weight.shape
    padded = weight.new_zeros(-(-N // bn) * bn, -(-K // bk) * bk)
    padded[:N, :K] = weight
    out = Fp8Quantize(quantizer)._quantize_one("w.weight", padded)
    return out["w.weight"][:N, :K].contiguous(), out["w.weight_scale_inv"]


def _experts(src, dst, quantizer, block) -> None:
    """Fill HF's FP8Experts dst from the 16-bit experts src (gate_up_proj [E, 2I, H],
    down_proj [E, H, I])."""
    I = src.gate_up_proj.shape[1] // 2
    for name, parts in (("gate_up_proj", (slice(0, I), slice(I, 2 * I))),
                        ("down_proj", (slice(None),))):
        ws, ss = [], []
        for e in range(src.gate_up_proj.shape[0]):
            qs = [_quantize(getattr(src, name)[e, p].detach(), quantizer, block) for p in parts]
            ws.append(torch.cat([q for q, _ in qs]))
            ss.append(torch.cat([s for _, s in qs]))
        setattr(dst, name, torch.nn.Parameter(torch.stack(ws), requires_grad=False))
        setattr(dst, name + "_scale_inv",
                torch.nn.Parameter(torch.stack(ss), requires_grad=False))


def quantize_fp8(model, skip=("lm_head",), block=(128, 128)):
    """A copy of `model` whose linears and routed experts are HF's FP8Linear / FP8Experts
    holding fp8 weights and fp32 block scales (the modules named in `skip` kept)."""
    import copy

    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import (FP8Experts, FP8Linear,
                                                           replace_with_fp8_linear)
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    qc = FineGrainedFP8Config(weight_block_size=list(block), modules_to_not_convert=list(skip))
    quantizer = FineGrainedFP8HfQuantizer(qc)
    src = model
    model = copy.deepcopy(model)
    replace_with_fp8_linear(model, modules_to_not_convert=list(skip), quantization_config=qc,
                            pre_quantized=True)
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, FP8Experts):
                _experts(src.get_submodule(name), m, quantizer, block)
            elif isinstance(m, FP8Linear):
                w, s = _quantize(src.get_submodule(name).weight.detach(), quantizer, block)
                m.weight = torch.nn.Parameter(w, requires_grad=False)
                m.weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)
    return model
