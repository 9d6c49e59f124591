"""examples/families_demo.py stays runnable: --list names every family of convert()'s table,
and a run on a tiny model of a family reports the converted tokens equal to HF's."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mla_ops.hf.families import FAMILY_NAMES

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "families_demo.py"


def demo():
    spec = importlib.util.spec_from_file_location("families_demo", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_list_names_every_family():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    run = subprocess.run([sys.executable, str(SCRIPT.relative_to(ROOT)), "--list"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    listed = [line.split()[0] for line in run.stdout.splitlines()]
    assert listed == list(FAMILY_NAMES)


@pytest.mark.parametrize("family", ["glm4_moe_lite", "kimi_linear"])
def test_family_run_matches_hf(family, capsys):
    assert demo().main(["--family", family, "--new", "8", "--lengths", "4,11"]) == 0
    out = capsys.readouterr().out
    assert "tokens match: True" in out and "tokens/s" in out


def test_unknown_family_is_refused(capsys):
    with pytest.raises(SystemExit):
        demo().main(["--family", "llama"])
    assert "--family must be one of" in capsys.readouterr().err
