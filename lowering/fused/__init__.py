"""Fused small kernels of a decode step, one kernel per file with its launcher and op
beside it: the attention prologue (prologue.py), the query's RoPE (q_rope.py), q_b + RoPE +
absorption (q_absorb.py), RMSNorm (norm.py), and the fp8 quant kernels (static_quant.py,
group_quant.py, concat_quant.py, wuv_quant.py; their shared e4m3 rounding in
fp8_rounding.py)."""
