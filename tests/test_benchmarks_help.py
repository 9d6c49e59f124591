"""The maintained benchmarks stay runnable: every script in benchmarks/ answers --help
(exit 0, a usage line) on a machine without a GPU, run from the repository root as the
README says (`python benchmarks/NAME.py`), and none edits sys.path to find its imports."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def scripts() -> list[Path]:
    """The benchmark scripts: the files of benchmarks/ run as programs (the rest, such as
    timing.py, are helpers they import)."""
    return sorted(p for p in BENCHMARKS.glob("*.py")
                  if 'if __name__ == "__main__":' in p.read_text())


def test_benchmark_scripts_found():
    names = {p.name for p in scripts()}
    assert {"bench_decode.py", "bench_hf_decode.py"} <= names, names


def test_every_benchmark_answers_help():
    env = dict(os.environ)
    # the tree under test first, as the rest of the suite imports it
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    runs = {p.name: subprocess.Popen([sys.executable, str(p.relative_to(ROOT)), "--help"],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
            for p in scripts()}       # in parallel: each run imports torch
    failed = []
    for name, proc in runs.items():
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 0 or not out.startswith(f"usage: {name}"):
            failed.append(f"{name}: exit {proc.returncode}\n{out[-1000:]}\n{err[-2000:]}")
    assert not failed, "\n\n".join(failed)


def test_no_benchmark_edits_sys_path():
    # benchmarks/ is on sys.path when a script runs; the library is the installed package
    hacks = [p.name for p in BENCHMARKS.glob("*.py") if "sys.path" in p.read_text()]
    assert not hacks, hacks
