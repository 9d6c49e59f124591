"""The routed experts of a DeepSeek MoE block for a decode step's few rows (experts.py: the
op mla::moe_experts_decode and its launchers; one kernel per file beside it)."""
