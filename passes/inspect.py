"""mla-inspect: compile a model with the MLA toolkit and show what the passes did.

    mla-inspect --model tiny-v3 --phase decode --kv-cache-dtype fp8 --fp8-o-proj [--json]
    python -m passes.inspect --model path/to/checkpoint_dir_or_config.json --html out.html

The model is built from its config with random weights (bf16, CPU unless --device),
converted with mla_ops.hf.convert, optionally given FP8 block-quantized o_proj layers,
and one step (decode after a short prefill, or a prefill) is compiled through
passes.compile_with_passes and run twice. Reported: the FX graph before and after the
passes, a fusion report (per pass, pattern and layer: matched, or the failed condition),
custom-op counts before and after, graph breaks and recompiles (compiles after the first
call), the decode backend chosen, and the kernels in Inductor's generated code.
"""
from __future__ import annotations

import argparse
import html
import json
import os
import re
import sys
from collections import Counter

import torch

TINY = {
    "tiny-v3": dict(vocab_size=256, hidden_size=256, intermediate_size=256,
                    moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, q_lora_rank=192, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                    first_k_dense_replace=1, max_position_embeddings=256),
    "tiny-v2": dict(vocab_size=256, hidden_size=256, intermediate_size=256,
                    moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                    first_k_dense_replace=1, max_position_embeddings=256),
}
B, PROMPT = 2, 5


def load_config(spec: str):
    import transformers
    if spec in TINY:
        cls = transformers.DeepseekV3Config if spec == "tiny-v3" else transformers.DeepseekV2Config
        return cls(**TINY[spec])
    path = os.path.dirname(spec) if spec.endswith(".json") else spec
    if not os.path.exists(os.path.join(path, "config.json")):
        raise SystemExit(f"mla-inspect: {spec!r} is neither {sorted(TINY)} nor a directory / "
                         f"config.json of an HF checkpoint")
    return transformers.AutoConfig.from_pretrained(path)


def build_model(cfg, fp8_o_proj: bool, device, fp8_q_scale: float | None = None):
    import transformers
    import mla_ops.hf as hf
    from passes.fp8_linear import Fp8BlockLinear
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).to(device).eval()
    hf.convert(model, fp8_decode_query=fp8_q_scale)
    if fp8_o_proj:
        for mod in model.modules():
            if hasattr(mod, "o_proj") and isinstance(mod.o_proj, torch.nn.Linear):
                mod.o_proj = Fp8BlockLinear.from_linear(mod.o_proj)
    return model


def normalize_graph(text: str) -> str:
    """An FX graph print with what varies between runs stripped, for golden tests.

    Node names are renumbered in order of appearance (inputs in0.., other nodes n0..),
    user counts and placeholder targets dropped, floats rounded to 6 significant digits.
    """
    names: dict = {}
    count = Counter()

    def rename(name: str, placeholder: bool = False) -> str:
        if name not in names:
            kind = "in" if placeholder else "n"
            names[name] = f"{kind}{count[kind]}"
            count[kind] += 1
        return names[name]

    out = []
    for line in text.strip().splitlines():
        line = re.sub(r" : \[num_users=\d+\]", "", line)
        m = re.match(r"(\s*)%(\w+) = placeholder\[target=\w+\]$", line)
        if m:
            out.append(f"{m.group(1)}%{rename(m.group(2), True)} = placeholder")
            continue
        line = re.sub(r"%(\w+)", lambda m: "%" + rename(m.group(1)), line)
        if line.strip().startswith("return"):
            line = re.sub(r"\b(\w+)\b", lambda m: names.get(m.group(1), m.group(1)), line)
        line = re.sub(r"(?<![\w.])(\d+\.\d{7,})", lambda m: f"{float(m.group(1)):.6g}", line)
        out.append(line.rstrip())
    return "\n".join(out) + "\n"


def count_generated_kernels(codes) -> dict:
    text = "\n".join(codes)
    return {"triton": len(re.findall(r"async_compile\.triton\(", text)),
            "cpp": len(re.findall(r"async_compile\.cpp(?:_pybinding)?\(", text)),
            "extern_mla_ops": len(re.findall(r"torch\.ops\.mla\.\w+", text))}


def run(args) -> dict:
    import lowering
    import torch._dynamo.utils as dyn_utils
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code
    import mla_ops.hf as hf
    from passes import compile_with_passes
    from passes.manager import MLAFusionPass

    cfg = load_config(args.model)
    dev = torch.device(args.device)
    if args.fp8_q_scale is not None and args.kv_cache_dtype != "fp8":
        raise SystemExit("mla-inspect: --fp8-q-scale needs --kv-cache-dtype fp8")
    model = build_model(cfg, args.fp8_o_proj, dev, args.fp8_q_scale)

    class CountingFusionPass(MLAFusionPass):
        """Counts Inductor compiles (one pass call each); otherwise the same pass."""
        calls = 0

        def __call__(self, graph):
            type(self).calls += 1
            return super().__call__(graph)

    fusion = CountingFusionPass()
    return _run(args, cfg, model, fusion, hf, lowering, dyn_utils, inductor_config,
                run_and_get_code, compile_with_passes, dev)


def _run(args, cfg, model, fusion, hf, lowering, dyn_utils, inductor_config,
         run_and_get_code, compile_with_passes, dev):
    torch._dynamo.reset()
    dyn_utils.counters.clear()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (B, PROMPT), generator=g).to(dev)

    def new_cache():
        c = hf.PagedMLACache(model.config, max_batch_size=B, max_cache_len=64, block_size=16,
                             dtype=torch.bfloat16, kv_cache_dtype=args.kv_cache_dtype,
                             k_scale=0.05, device=dev)
        for t in c.pool.kv:
            t.zero_()
        return c

    cache_name = next(iter(hf.cache_kwargs(model, None)))   # "cache" (>= 5.24) or the old name

    def step(tok, cache, pos):
        return model(input_ids=tok, cache_position=pos, **{cache_name: cache}).logits

    compiled = compile_with_passes(step, fusion=fusion)
    codes, first_calls = [], 0
    lowering.backend_choices.clear()
    with torch.no_grad(), inductor_config.patch(fx_graph_cache=False):
        for i in range(2):
            cache = new_cache()
            if args.phase == "decode":
                model(input_ids=ids, attention_mask=torch.ones_like(ids), **{cache_name: cache})
                tok, pos = ids[:, -1:], torch.tensor([PROMPT], device=dev)
                if i:
                    model(input_ids=tok, cache_position=pos, **{cache_name: cache})
                    pos = pos + 1
            else:
                tok, pos = ids, torch.arange(PROMPT, device=dev)
            if i == 0:
                _, codes = run_and_get_code(compiled, tok, cache, pos)
                first_calls = fusion.calls
            else:
                compiled(tok, cache, pos)
    graph_breaks = sum(dyn_utils.counters["graph_break"].values())
    backends = sorted(lowering.backend_choices)
    report = {
        "model": args.model, "phase": args.phase, "kv_cache_dtype": args.kv_cache_dtype,
        "fp8_o_proj": bool(args.fp8_o_proj),
        "fp8_q_scale": args.fp8_q_scale,
        "graph_breaks": int(graph_breaks),
        "graph_break_reasons": sorted(dyn_utils.counters["graph_break"]),
        "compiles": fusion.calls,
        "recompiles": fusion.calls - first_calls,
        "ops_before": custom_ops(fusion.ops_before),
        "ops_after": custom_ops(fusion.ops_after),
        "fusions": fusion_rows(fusion, args, attention_layers(fusion)),
        "backend": ",".join(backends) if backends else "none (no decode rows: prefill path)",
        "backend_calls": dict(lowering.backend_choices),
        "kernels": count_generated_kernels(codes),
        "graph_before": fusion.graph_before,
        "graph_after": fusion.graph_after,
    }
    return report


def custom_ops(counter: Counter) -> dict:
    """Counts of the mla:: ops (the ones the passes change); aten ops are left out."""
    return {k: v for k, v in sorted(counter.items()) if k.startswith("mla::")}


def attention_layers(fusion) -> int:
    return fusion.ops_before.get("mla::attention_with_output", 0)


def fusion_rows(fusion, args, n_layers: int) -> list:
    rows = [dict(**{"pass": "A" if r["pass_"] == "A" else "B"}, pattern=r["pattern"],
                 layer=r["layer"], matched=bool(r["matched"]), reason=r["reason"])
            for r in fusion.records]
    have_a = {r["layer"] for r in rows if r["pass"] == "A"}
    for layer in range(n_layers):
        if layer in have_a:
            continue
        if args.phase == "prefill":
            why = "prefill step: no decode rows, so no decode query to quantize"
        elif args.kv_cache_dtype == "auto":
            why = ("bf16 KV cache: the decode query stays bf16 inside the op (Pass A needs an "
                   "fp8 cache and an fp8 decode query)")
        else:
            why = ("no fp8 decode query in the graph: the model passes bf16 q to the op "
                   "(convert with fp8_decode_query=q_scale, or --fp8-q-scale here)")
        rows.append({"pass": "A", "pattern": "cat_quant_fp8_static", "layer": layer,
                     "matched": False, "reason": why})
    return sorted(rows, key=lambda r: (r["pass"], r["layer"] if r["layer"] is not None else -1))


def format_text(rep: dict) -> str:
    out = [f"== mla-inspect: {rep['model']}  phase={rep['phase']}  "
           f"kv_cache_dtype={rep['kv_cache_dtype']}  fp8_o_proj={rep['fp8_o_proj']}",
           "", "-- FX graph before the passes (post-grad)", rep["graph_before"].rstrip(),
           "", "-- FX graph after the passes", rep["graph_after"].rstrip(), "",
           "-- fusion report"]
    for r in rep["fusions"]:
        status = "matched" if r["matched"] else f"not matched: {r['reason']}"
        out.append(f"  pass {r['pass']}  layer {r['layer']}  {r['pattern']:<26} {status}")
    out += ["", "-- custom ops          before  after"]
    for k in sorted(set(rep["ops_before"]) | set(rep["ops_after"])):
        out.append(f"  {k:<28} {rep['ops_before'].get(k, 0):>5}  {rep['ops_after'].get(k, 0):>5}")
    k = rep["kernels"]
    out += ["", f"graph breaks: {rep['graph_breaks']}  compiles: {rep['compiles']}  "
                f"recompiles: {rep['recompiles']}",
            f"decode backend: {rep['backend']}  (calls: {rep['backend_calls']})",
            f"generated kernels: triton {k['triton']}, cpp {k['cpp']}; "
            f"mla op calls in the generated code: {k['extern_mla_ops']}"]
    return "\n".join(out) + "\n"


def format_html(rep: dict) -> str:
    e = html.escape
    rows = "".join(
        f"<tr><td>{e(r['pass'])}</td><td>{r['layer']}</td><td>{e(r['pattern'])}</td>"
        f"<td>{'yes' if r['matched'] else 'no'}</td><td>{e(r['reason'])}</td></tr>"
        for r in rep["fusions"])
    return (
        "<!doctype html><meta charset=utf-8><title>mla-inspect</title>"
        "<style>body{font-family:sans-serif}.g{display:flex;gap:1em}"
        ".g pre{flex:1;overflow:auto;font-size:11px;background:#f6f6f6;padding:.5em}"
        "td,th{border:1px solid #ccc;padding:2px 6px}</style>"
        f"<h1>{e(rep['model'])} &middot; {e(rep['phase'])} &middot; kv {e(rep['kv_cache_dtype'])}"
        f" &middot; fp8 o_proj {rep['fp8_o_proj']}</h1>"
        "<table><tr><th>pass</th><th>layer</th><th>pattern</th><th>matched</th><th>reason</th></tr>"
        f"{rows}</table><div class=g><div style=flex:1><h2>before</h2><pre>"
        f"{e(rep['graph_before'])}</pre></div><div style=flex:1><h2>after</h2><pre>"
        f"{e(rep['graph_after'])}</pre></div></div>")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="mla-inspect", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-v3",
                    help="tiny-v3, tiny-v2, or an HF checkpoint directory / config.json")
    ap.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    ap.add_argument("--fp8-o-proj", action="store_true",
                    help="replace o_proj by FP8 block-quantized linears (128x128, acts g128)")
    ap.add_argument("--fp8-q-scale", type=float, default=None, metavar="S",
                    help="build the decode query in the graph as fp8 with static scale S "
                         "(needs --kv-cache-dtype fp8); Pass A can then fuse its cat + quant")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--html", metavar="FILE", help="also write the two graphs side by side")
    ap.add_argument("--device", default="cpu")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # Triton kernels of a CPU run go through the interpreter. The variable is set for
    # this call only (Inductor reads it whenever it compiles), but kernels first imported
    # during the call stay interpreted (Triton decides when it decorates them): a process
    # that also runs CUDA kernels should run a CPU report in a process of its own.
    interpret = args.device == "cpu" and "TRITON_INTERPRET" not in os.environ
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        rep = run(args)
    finally:
        if interpret:
            del os.environ["TRITON_INTERPRET"]
    if args.html:
        with open(args.html, "w") as f:
            f.write(format_html(rep))
    if args.json:
        print(json.dumps(rep))
    else:
        sys.stdout.write(format_text(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
