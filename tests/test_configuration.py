"""Configuration: one environment prefix, every variable in the table of the configuration
guide (docs/guide/configuration.md) with its default; nothing that changes results is an
environment variable; fault injection is switched on from ``tf_fusedemb.testing`` only;
``import tf_fusedemb`` leaves file descriptor 2 alone, and quieting TensorFlow is the
explicit ``quiet.install()``."""
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

# Where the package and its tooling read or set environment variables.
SOURCES = ["tf_fusedemb", "examples", "tests", "Makefile", "setup.py", "BUILD"]
OWN_VAR = re.compile(r"\b(?:TF_)?FUSEDEMB_[A-Z0-9_]*[A-Z0-9]\b")
# Not environment variables: markers of result lines on stdout, and the renamed names the
# benchmark launcher refuses (tf_fusedemb.benchmarks.launcher.RENAMED_ENV).
NOT_VARIABLES = {"FUSEDEMB_INFERENCE_RESULT", "FUSEDEMB_LINK_RATE"}
RENAMED = {"FUSEDEMB_BENCH_NICE", "FUSEDEMB_COMM_THREAD_NICE"}
GONE = {"TF_FUSEDEMB_EXCHANGE", "TF_FUSEDEMB_FAULT"}  # named only where tests check they're gone


def _files():
    for entry in SOURCES:
        path = REPO_ROOT / entry
        if path.is_file():
            yield path
        for p in sorted(path.rglob("*")) if path.is_dir() else ():
            if p.suffix in (".py", ".cc", ".h", ".md") and "__pycache__" not in p.parts:
                yield p


def _names_in_code():
    found = {}
    for path in _files():
        if path.name == "test_configuration.py":
            continue
        for name in OWN_VAR.findall(path.read_text(errors="replace")):
            found.setdefault(name, set()).add(str(path.relative_to(REPO_ROOT)))
    return found


def _guide_table():
    """{variable: (default, what)} of the configuration guide's table of environment
    variables."""
    text = (REPO_ROOT / "docs" / "guide" / "configuration.md").read_text()
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].split("`")[1]] = (cells[1], cells[2])
    return rows


def test_one_prefix_and_every_variable_in_the_configuration_guide():
    table = _guide_table()
    found = _names_in_code()
    variables = set(found) - NOT_VARIABLES - RENAMED - GONE
    assert variables, "no TF_FUSEDEMB_ variable found: the scan is broken"
    other_prefix = {n: sorted(f) for n, f in found.items()
                    if not n.startswith("TF_FUSEDEMB_") and n not in NOT_VARIABLES | RENAMED}
    assert not other_prefix, f"variables outside the TF_FUSEDEMB_ prefix: {other_prefix}"
    missing = sorted(variables - set(table))
    assert not missing, f"not in the configuration guide's table: {missing} (used in " \
        f"{ {n: sorted(found[n]) for n in missing} })"
    stale = sorted(n for n in table if n.startswith("TF_FUSEDEMB_") and n not in variables)
    assert not stale, f"in the configuration guide's table but nowhere in the code: {stale}"
    for name, (default, what) in table.items():
        assert default and what, f"{name}: the table needs its default and what it does"
    # The renamed names appear only where the launcher refuses them (and in this check).
    for name in RENAMED:
        assert set(found.get(name, ())) <= {"tf_fusedemb/benchmarks/launcher.py"}, found[name]
    for name in GONE:  # no production code reads them any more
        assert not [f for f in found.get(name, ()) if f.startswith("tf_fusedemb/")], found[name]


def test_nothing_in_the_package_reads_an_exchange_or_fault_variable(monkeypatch):
    """What changes the graph is an argument: the environment cannot switch the exchange."""
    from tf_fusedemb.layers import FusedEmbedding
    from tf_fusedemb.specs import FeatureSpec, OptimizerSpec, TableSpec
    monkeypatch.setenv("TF_FUSEDEMB_EXCHANGE", "hierarchical")
    specs = [FeatureSpec("a", TableSpec("a", 4, OptimizerSpec.sgd(0.1)))]
    assert FusedEmbedding(specs).exchange is None  # the default: "auto", by argument only
    assert {c.kind for c in FusedEmbedding(specs).exchanges.values()} == {"flat"}


def test_renamed_benchmark_variables_are_refused_naming_the_new_ones():
    from tf_fusedemb.benchmarks import launcher
    launcher.check_renamed_env({"TF_FUSEDEMB_BENCH_NICE": "-15"})  # the new name is fine
    with pytest.raises(SystemExit, match="FUSEDEMB_BENCH_NICE is now TF_FUSEDEMB_BENCH_NICE"):
        launcher.check_renamed_env({"FUSEDEMB_BENCH_NICE": "-15"})
    out = subprocess.run([sys.executable, "-m", "tf_fusedemb.benchmarks.lookup", "--json"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, FUSEDEMB_COMM_THREAD_NICE="-20"))
    assert out.returncode != 0, out
    assert "FUSEDEMB_COMM_THREAD_NICE is now TF_FUSEDEMB_COMM_THREAD_NICE" in out.stderr, out.stderr


# ---- import tf_fusedemb leaves stderr alone; quieting is explicit ----------------------
FAKE_TF = '''import os
FD2_INODE = os.fstat(2).st_ino
os.write(2, b"MARK: written to fd 2 while tensorflow imports\\n")
'''
PROBE = '''import os, sys
before = os.fstat(2).st_ino
import tf_fusedemb
import tensorflow
print("fd2 unchanged during the import:", tensorflow.FD2_INODE == before, flush=True)
print("finders:", [type(f).__module__ for f in sys.meta_path], flush=True)
print("TF_USE_LEGACY_KERAS=" + os.environ.get("TF_USE_LEGACY_KERAS", ""), flush=True)
print("TF_CPP_MIN_LOG_LEVEL=" + os.environ.get("TF_CPP_MIN_LOG_LEVEL", "unset"), flush=True)
'''


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TF_CPP", "TF_USE_LEGACY", "HOROVOD"))}
    env.update(extra)
    return env


def test_import_does_not_redirect_fd2(tmp_path):
    """A stand-in ``tensorflow`` (first on the path) writes to fd 2 while it is imported
    after ``import tf_fusedemb``: its line reaches stderr as written, fd 2 is the process's
    own during the import, no import hook of tf_fusedemb is installed, and no environment
    variable is set (which Keras a program uses is its own choice)."""
    (tmp_path / "tensorflow").mkdir()
    (tmp_path / "tensorflow" / "__init__.py").write_text(FAKE_TF)
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120,
                         env=_clean_env(PYTHONPATH=os.pathsep.join([str(tmp_path),
                                                                    str(REPO_ROOT)])))
    assert out.returncode == 0, out.stderr
    assert "MARK: written to fd 2 while tensorflow imports" in out.stderr
    assert "fd2 unchanged during the import: True" in out.stdout, out.stdout
    assert "tf_fusedemb" not in out.stdout.split("finders:", 1)[1].splitlines()[0], out.stdout
    assert "TF_USE_LEGACY_KERAS=\n" in out.stdout and "TF_CPP_MIN_LOG_LEVEL=unset" in out.stdout


@pytest.mark.timeout(300)
def test_import_then_real_tensorflow_is_not_filtered_and_install_is(tmp_path):
    """With the real TensorFlow: after ``import tf_fusedemb`` alone TensorFlow's own import
    lines reach stderr unfiltered (the three CUDA-factory errors of TF 2.16's wheel, where
    this wheel prints them); after ``tf_fusedemb.quiet.install()`` they do not, and a line
    written to fd 2 during that import still arrives."""
    plain = subprocess.run([sys.executable, "-c", "import tf_fusedemb, tensorflow"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=200,
                           env=_clean_env(TF_CPP_MIN_LOG_LEVEL="2"))
    assert plain.returncode == 0, plain.stderr
    quiet = subprocess.run(
        [sys.executable, "-c", "import os, tf_fusedemb; tf_fusedemb.quiet.install(); "
                               "import tensorflow; os.write(2, b'after\\n')"],
        cwd=tmp_path, capture_output=True, text=True, timeout=200, env=_clean_env())
    assert quiet.returncode == 0, quiet.stderr
    assert "Unable to register cu" not in quiet.stderr, quiet.stderr
    assert quiet.stderr.rstrip().endswith("after"), quiet.stderr
    if "Unable to register cu" not in plain.stderr:
        pytest.skip("this TensorFlow prints no CUDA-factory lines: nothing to filter")


@pytest.mark.timeout(300)
def test_install_drops_the_no_driver_cuinit_line_only(tmp_path):
    """On a machine without a CUDA driver TensorFlow's device discovery logs one cuInit
    ERROR line (error 303) at the first op; after ``quiet.install()`` that line is gone,
    while another C++-style error line written to fd 2 afterwards still arrives."""
    script = ("import os, tf_fusedemb; tf_fusedemb.quiet.install(); import tensorflow as tf; "
              "tf.constant(1) + 1; os.write(2, b'E0000 x cuda_platform.cc:52] failed call "
              "to cuInit: INTERNAL: CUDA error: CUDA_ERROR_OUT_OF_MEMORY\\n')")
    quiet = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                           text=True, timeout=200, env=_clean_env())
    assert quiet.returncode == 0, quiet.stderr
    assert "UNKNOWN ERROR (303)" not in quiet.stderr, quiet.stderr
    assert "CUDA_ERROR_OUT_OF_MEMORY" in quiet.stderr, quiet.stderr
