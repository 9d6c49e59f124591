"""Weight-streaming Triton GEMMs for a decode step's few rows: the HF layers' linears
(linear.py; fp8_linear.py over FP8 block-quantized weights) and the absorbed per-head GEMMs
(head_gemm.py)."""
