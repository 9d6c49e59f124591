"""Plot decode results (JSON from bench_decode.py) as achieved TFLOP/s and GB/s per shape.

    python benchmarks/plot_decode.py benchmarks/decode_results.json benchmarks/decode.png
"""
import argparse
import json

IMPLS = [("flashmla", "FlashMLA"), ("flashmla[kernel only]", "FlashMLA kernels only"),
         ("flashmla_fp8q", "FlashMLA FP8 q+cache"),
         ("gluon_bf16", "Gluon BF16 (ours, Hopper, pair kernel)"),
         ("gluon_bf16[ring]", "Gluon BF16 ring kernel (pages of 32)"),
         ("gluon_fp8q", "Gluon FP8 q+cache (ours)"),
         ("triton_bf16[default]", "Triton BF16"),
         ("triton_fp8kv[default]", "Triton FP8 cache"), ("triton_fp8q[default]", "Triton FP8 q+cache"),
         ("reference", "pure torch")]


def main(src, dst):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(src))
    rows = data["rows"]
    shapes = []
    for r in rows:
        if (r["B"], r["H"], r["S"]) not in shapes:
            shapes.append((r["B"], r["H"], r["S"]))
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.6))
    width = 0.8 / len(IMPLS)
    for ax, key, label, ceil in ((axes[0], "tflops", "achieved TFLOP/s", data["gemm"] / 1e12),
                                 (axes[1], "gbps", "achieved GB/s (KV bytes read)", data["copy_bw"] / 1e9)):
        for i, (impl, name) in enumerate(IMPLS):
            vals = []
            for shp in shapes:
                match = [r for r in rows if (r["B"], r["H"], r["S"]) == shp and r["impl"] == impl]
                vals.append(match[0][key] if match else 0.0)
            ax.bar([x + i * width for x in range(len(shapes))], vals, width, label=name)
        ax.axhline(ceil, color="k", ls="--", lw=1)
        ax.text(len(shapes) - 0.6, ceil, "measured ceiling", va="bottom", ha="right", fontsize=8)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))])
        ax.set_xticklabels([f"B{b} H{h}\nS{s}" for b, h, s in shapes], fontsize=8)
        ax.set_ylabel(label)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.suptitle(f"MLA decode, BF16/FP8 latent cache, page 64 — {data['gpu']}, torch {data['torch']}, "
                 f"triton {data['triton']}", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="bench_decode.py's JSON, e.g. benchmarks/decode_results.json")
    ap.add_argument("dst", help="the PNG to write, e.g. benchmarks/decode.png")
    args = ap.parse_args()
    main(args.src, args.dst)
