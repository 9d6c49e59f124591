"""mla_ops.hf refuses a transformers older than it runs on, with a message that names the
installed version and the fix, and the minimum is the one pyproject.toml pins."""
import pathlib
import re

import pytest

from mla_ops.hf.requirements import MIN_TRANSFORMERS, check_transformers_version


@pytest.mark.parametrize("version", ["5.17.0", "5.22.2", "4.57.6", "5.9.0"])
def test_older_transformers_is_refused_with_the_fix(version):
    with pytest.raises(ImportError, match=rf"transformers >= 5\.23, found {re.escape(version)}"
                                          r".*pip install -U 'transformers>=5\.23'"):
        check_transformers_version(version)


@pytest.mark.parametrize("version", ["5.23.0", "5.24.0", "5.25.0.dev0", "5.100.1", "6.0.0"])
def test_supported_transformers_passes(version):
    check_transformers_version(version)


def test_unreadable_version_is_refused():
    with pytest.raises(ImportError, match="cannot read the transformers version 'main'"):
        check_transformers_version("main")


def test_minimum_matches_pyproject():
    text = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    pins = re.findall(r'"transformers>=(\d+)\.(\d+)"', text)
    assert pins and all((int(a), int(b)) == MIN_TRANSFORMERS for a, b in pins), pins


def test_installed_transformers_passes():
    import transformers
    check_transformers_version(transformers.__version__)


def test_import_checks_the_installed_version():
    import subprocess
    import sys
    code = ("import transformers; transformers.__version__ = '5.17.0'\n"
            "import mla_ops.hf")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=pathlib.Path(__file__).parents[1])
    assert r.returncode != 0
    assert "ImportError: mla_ops.hf needs transformers >= 5.23, found 5.17.0" in r.stderr, r.stderr
