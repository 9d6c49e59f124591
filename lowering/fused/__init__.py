"""Fused small kernels of a decode step: the attention prologue and the absorbed query
(prologue.py), the query's RoPE, RMSNorm (norm.py), and the fp8 quant kernels."""
