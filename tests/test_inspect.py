"""The mla-inspect tool: JSON report, text and HTML output, and the reasons it gives."""
import json
import os

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402

from passes import inspect as mla_inspect  # noqa: E402

# The tool's CPU runs set TRITON_INTERPRET=1 before importing the kernels, and Triton
# makes every kernel decorated while it is set an interpreted one for good: on a CUDA
# host the GPU tests later in the same process would then get interpreted kernels
# ("wrap_triton only works on functions annotated with triton.jit"). CPU CI runs these.
cpu_run = pytest.mark.skipif(torch.cuda.is_available(),
                             reason="runs the tool on CPU through the Triton interpreter")


def run_json(capsys, *argv):
    assert mla_inspect.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@cpu_run
def test_decode_fp8_with_fp8_o_proj(capsys):
    rep = run_json(capsys, "--model", "tiny-v3", "--phase", "decode", "--kv-cache-dtype", "fp8",
                   "--fp8-o-proj")
    for key, typ in (("graph_breaks", int), ("recompiles", int), ("ops_before", dict),
                     ("ops_after", dict), ("fusions", list), ("backend", str)):
        assert isinstance(rep[key], typ), key
    assert rep["graph_breaks"] == 0 and rep["recompiles"] == 0
    assert rep["ops_before"]["mla::quant_fp8_group"] == 2
    assert "mla::quant_fp8_group" not in rep["ops_after"]
    assert rep["ops_after"]["mla::kv_cache_update"] == 2
    b = [f for f in rep["fusions"] if f["pass"] == "B"]
    assert [(f["layer"], f["matched"], f["reason"]) for f in b] == [(0, True, ""), (1, True, "")]
    assert {f["pattern"] for f in b} == {"fp8_dynamic_group128"}
    a = [f for f in rep["fusions"] if f["pass"] == "A"]
    assert len(a) == 2 and not any(f["matched"] for f in a)
    assert all("decode query" in f["reason"] for f in a)
    assert rep["backend"] == "reference"                # CPU: the torch decode backend
    assert rep["kernels"]["cpp"] > 0
    assert "mla.attention_with_output" in rep["graph_after"]


@cpu_run
def test_fp8_decode_query_lets_pass_a_fire(capsys, tmp_path):
    dense_config(tmp_path, "tiny-v3")
    rep = run_json(capsys, "--model", str(tmp_path), "--phase", "decode", "--kv-cache-dtype",
                   "fp8", "--fp8-q-scale", "0.05")
    a = [f for f in rep["fusions"] if f["pass"] == "A"]
    assert [(f["layer"], f["matched"], f["reason"]) for f in a] == [(0, True, ""), (1, True, "")]
    assert rep["ops_before"]["mla::quant_fp8_static"] == 2
    assert rep["ops_after"]["mla::concat_quant_fp8_static"] == 2
    assert rep["graph_breaks"] == 0 and rep["recompiles"] == 0
    with pytest.raises(SystemExit, match="needs --kv-cache-dtype fp8"):
        mla_inspect.main(["--model", str(tmp_path), "--fp8-q-scale", "0.05"])


def dense_config(tmp_path, family):
    """A local checkpoint directory holding only a config.json (dense MLP layers: faster)."""
    import transformers
    cls = transformers.DeepseekV3Config if family == "tiny-v3" else transformers.DeepseekV2Config
    cls(**dict(mla_inspect.TINY[family], first_k_dense_replace=2)).save_pretrained(tmp_path)
    return tmp_path


@cpu_run
def test_pass_b_cannot_fire_without_fp8_o_proj_and_says_why(capsys, tmp_path):
    # a checkpoint given by its config.json, bf16 cache, o_proj left in bf16
    dense_config(tmp_path, "tiny-v3")
    html = tmp_path / "graphs.html"
    rep = run_json(capsys, "--model", str(tmp_path / "config.json"), "--phase", "decode",
                   "--html", str(html))
    b = [f for f in rep["fusions"] if f["pass"] == "B"]
    assert len(b) == 2 and not any(f["matched"] for f in b)
    assert all("not an FP8 quant op" in f["reason"] for f in b)
    a = [f for f in rep["fusions"] if f["pass"] == "A"]
    assert all("bf16 KV cache" in f["reason"] for f in a)
    assert rep["ops_before"] == rep["ops_after"]
    page = html.read_text()
    assert page.count("<pre>") == 2 and "not an FP8 quant op" in page


@cpu_run
def test_text_report_prefill(capsys, tmp_path):
    assert mla_inspect.main(["--model", str(dense_config(tmp_path, "tiny-v2")), "--phase", "prefill",
                             "--kv-cache-dtype", "fp8", "--fp8-o-proj"]) == 0
    out = capsys.readouterr().out
    for part in ("FX graph before the passes", "FX graph after the passes", "fusion report",
                 "custom ops", "graph breaks: 0", "recompiles: 0", "decode backend: none"):
        assert part in out, part
    # prefill output rows are reordered before o_proj, so Pass B has no direct quant to fold
    assert "pass B  layer 0" in out and "not matched" in out
    assert "prefill step: no decode rows" in out


def test_normalize_graph_renames_and_rounds():
    text = ("graph():\n    %arg3_1 : [num_users=1] = placeholder[target=arg3_1]\n"
            "    %mul : [num_users=1] = call_function[target=torch.ops.aten.mul.Tensor]"
            "(args = (%arg3_1, 0.1767766952966369), kwargs = {})\n    return (mul,)")
    assert mla_inspect.normalize_graph(text) == (
        "graph():\n    %in0 = placeholder\n    %n0 = call_function[target=torch.ops.aten.mul."
        "Tensor](args = (%in0, 0.176777), kwargs = {})\n    return (n0,)\n")


@cpu_run
def test_bad_model_argument():
    with pytest.raises(SystemExit):
        mla_inspect.main(["--model", "/nonexistent/dir"])


def test_cli_leaves_the_interpreter_setting_as_it_found_it(monkeypatch):
    """A CPU run interprets Triton kernels for its own call only: a later CUDA compile in
    the same process (the GPU tests after this file) must not run in the interpreter."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    seen = []
    monkeypatch.setattr(mla_inspect, "run", lambda args: seen.append(
        os.environ.get("TRITON_INTERPRET")) or {})
    monkeypatch.setattr(mla_inspect, "format_text", lambda rep: "")
    assert mla_inspect.main([]) == 0
    assert seen == ["1"] and "TRITON_INTERPRET" not in os.environ
    monkeypatch.setenv("TRITON_INTERPRET", "0")           # a caller's own setting stays
    assert mla_inspect.main([]) == 0
    assert seen[-1] == "0" and os.environ["TRITON_INTERPRET"] == "0"
