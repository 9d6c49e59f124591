"""The routed experts of a DeepSeek MoE block for a decode step's few rows (experts.py: the
op mla::moe_experts_decode and its launchers; fp8_experts.py: mla::moe_experts_decode_fp8
over FP8 block-quantized experts; router.py: the router op mla::moe_route; block.py:
mla::moe_block_decode, router, routed and shared experts of a block in one op, the shared
experts on a second stream; fp8_block.py: mla::moe_block_decode_fp8, the same for an FP8
checkpoint's block; one kernel per file beside them)."""
