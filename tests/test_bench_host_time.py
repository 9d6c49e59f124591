"""benchmarks/bench_host_time.py runs on CPU (the reference backend) and writes its rows."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_host_time_benchmark_on_cpu(tmp_path):
    out = tmp_path / "host.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_host_time.py"), "--device", "cpu",
           "--shapes", "2x4x64", "--calls", "3", "--repeats", "2", "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    got = {(r["entry"], r["backend"]) for r in rows}
    assert got == {("mla_decode", "reference"), ("mla_decode", "auto"),
                   ("attention_with_output", "auto")}
    for r in rows:
        assert (r["B"], r["H"], r["S"]) == (2, 4, 64)
        assert r["host_us"] > 0 and r["gpu_us"] is None
    help_text = subprocess.run([sys.executable, cmd[1], "--help"], capture_output=True,
                               text=True, timeout=120)
    assert help_text.returncode == 0 and "--shapes" in help_text.stdout
