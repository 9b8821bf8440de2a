"""setup.py keeps the op library it built in a cache of the machine, under a key of what the
build reads, and a later build with the same key copies it instead of compiling: the key
is the same for another checkout of the same sources and differs when a source, a header
or the compiler flags differ; a build whose key is in the cache copies that file (a
placeholder here, so that nothing compiles) into the package and says so."""
import os
import runpy
import shutil
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(300)


def _checkout(path):
    """The files the build reads: setup.py, custom_ops/ (copies) and the README."""
    path.mkdir()
    shutil.copy(REPO_ROOT / "setup.py", path / "setup.py")
    shutil.copy(REPO_ROOT / "README.md", path / "README.md")
    shutil.copytree(REPO_ROOT / "custom_ops", path / "custom_ops")
    (path / "tf_fusedemb").mkdir()
    return path


def _key(checkout, monkeypatch, flags=("-DX",)):
    monkeypatch.chdir(checkout)
    build = runpy.run_path(str(checkout / "setup.py"), run_name="setup_under_test")
    return build["_build_key"]("g++", list(flags), []), build


def test_the_key_follows_the_sources_and_flags_not_the_checkout(tmp_path, monkeypatch):
    one, _ = _key(_checkout(tmp_path / "one"), monkeypatch)
    other = _checkout(tmp_path / "other")
    assert _key(other, monkeypatch)[0] == one
    assert _key(other, monkeypatch, flags=("-DY",))[0] != one
    with open(other / "custom_ops" / "engine_config.h", "a") as f:
        f.write("\n")
    assert _key(other, monkeypatch)[0] != one


def test_a_cached_library_is_copied_instead_of_compiled(tmp_path, monkeypatch):
    checkout = _checkout(tmp_path / "checkout")
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    _, build = _key(checkout, monkeypatch)
    key = build["_build_key"]("g++", *build["_tf_flags"]())  # as build_ext computes it
    name = f"_fusedemb_ops-{build['_tf_tag']()}.so"
    entry = cache / "tf_fusedemb" / "ops" / key / name
    entry.parent.mkdir(parents=True)
    entry.write_bytes(b"a library built earlier")
    out = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=checkout,
                         capture_output=True, text=True, timeout=240,
                         env={**os.environ, "XDG_CACHE_HOME": str(cache)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"copied the one built earlier ({entry})" in out.stdout, out.stdout[-2000:]
    assert (checkout / "tf_fusedemb" / name).read_bytes() == b"a library built earlier"
    assert not list(checkout.rglob("*.o")) and not list(checkout.rglob("*.gch"))  # no compile
