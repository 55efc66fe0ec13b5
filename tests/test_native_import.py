"""A zoo/ folder whose compiled core is missing, or built for another Python, says so and what
to do, instead of Python's bare "cannot import name '_native'" (zoo/core/native.py)."""

import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import zoo

SOURCE = Path(zoo.__file__).parent


def _import_copy(tmp_path: Path, extra_file: str = "") -> subprocess.CompletedProcess:
    """Imports a copy of zoo/ without its compiled core, the copy first on the path. -S keeps
    site's .pth files, an editable install's redirect among them, from reaching the installed zoo."""
    shutil.copytree(SOURCE, tmp_path / "zoo", ignore=shutil.ignore_patterns("_native*", "__pycache__"))
    if extra_file:
        (tmp_path / "zoo" / "core" / extra_file).write_bytes(b"")
    paths = [str(tmp_path), *site.getsitepackages()]
    code = f"import sys; sys.path[:0] = {paths!r}; import zoo"
    return subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120)


def test_an_unbuilt_checkout_says_how_to_build_it(tmp_path):
    r = _import_copy(tmp_path)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: zoo: no compiled core in ")
    assert str(tmp_path / "zoo" / "core") in last and "never built" in last and "make setup" in last


@pytest.mark.skipif(sys.platform == "win32", reason="the extension's name is Linux's and macOS's")
def test_a_core_built_for_another_python_is_named(tmp_path):
    other = "_native.cpython-39-x86_64-linux-gnu.so" if sys.version_info[:2] != (3, 9) else "_native.cpython-38-x86_64-linux-gnu.so"
    r = _import_copy(tmp_path, other)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert f"it holds {other}, built for another Python" in last


def test_a_broken_core_of_this_python_keeps_its_own_error(tmp_path):
    ours = "_native" + sysconfig.get_config_var("EXT_SUFFIX")
    r = _import_copy(tmp_path, ours)  # an empty file: the loader's own error, not "never built"
    assert r.returncode != 0 and "ImportError" in r.stderr
    assert "no compiled core" not in r.stderr and ours in r.stderr
