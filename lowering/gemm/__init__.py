"""Weight-streaming Triton GEMMs for a decode step's few rows: the HF layers' linears
(linear.py) and the absorbed per-head GEMMs (head_gemm.py)."""
