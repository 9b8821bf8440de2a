"""The package's import structure: every module imports on its own, no import cycle, no
import pointing up the layer order, function-local imports only with a reason.

The layer order (bottom to top; each layer may import only its own and lower ones) is
``tf_fusedemb.testing.module_graph.LAYERS``, described in that module's docstring::

    quiet < specs < ops < data < comm < storage < layers < training < pipeline < inference
      < models < keras3 < testing < benchmarks < job < train, serve < the package facade

The static checks read the source with ``ast`` (module_graph); the dynamic check imports
every module in a fresh interpreter state, so a cycle that only bites from one entry point
fails too. Negative controls: a synthetic graph and a synthetic package on disk with a
cycle and an upward import make the checkers fail.
"""
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

from tf_fusedemb.testing import module_graph as mg

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

# TensorFlow & co. are imported once; each module is then imported in a forked child that
# holds no tf_fusedemb module yet, so it is imported as the first of the package (as a
# user's first import would be), its op and gradient registrations its own.
_IMPORT_EACH = textwrap.dedent("""
    import json, os, sys, traceback
    import numpy, tensorflow, tf_keras  # noqa: F401  loaded once, before the forks
    graph_dir, root = sys.argv[1:3]  # module_graph.py's folder, the package's folder
    sys.path.insert(0, graph_dir)
    from module_graph import module_files  # the file itself: no tf_fusedemb module loaded
    sys.path[0] = os.path.dirname(root)
    names = sorted(module_files(root, os.path.basename(root)))
    failed = {}
    for name in names:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            status = 0
            try:
                __import__(name)
            except BaseException:  # noqa: BLE001  every failure is reported, traceback included
                os.write(write, traceback.format_exc(limit=-6).encode())
                status = 1
            os._exit(status)
        os.close(write)
        with os.fdopen(read, "rb") as f:
            message = f.read().decode(errors="replace")
        _, status = os.waitpid(pid, 0)
        if status != 0:
            failed[name] = message or f"exit status {status}"
    print("RESULT " + json.dumps({"imported": len(names) - len(failed), "failed": failed}))
""")


def _import_each(root):
    """{"imported": n, "failed": {module: traceback}} for the package at ``root``."""
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", _IMPORT_EACH, os.path.dirname(mg.__file__),
                           str(root)], cwd=pathlib.Path(root).parent, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_every_module_imports_as_the_first_of_the_package():
    result = _import_each(mg.ROOT)
    assert result["failed"] == {}, "\n".join(f"{k}:\n{v}" for k, v in result["failed"].items())
    assert result["imported"] == len(mg.module_files())


def test_import_each_fails_on_an_import_cycle(tmp_path):
    # Negative control: a cycle that breaks from one entry point (b first) and not the other.
    _write(tmp_path / "cyclic", {
        "__init__.py": "",
        "a.py": "from cyclic.b import B\nA = 1\n",
        "b.py": "from cyclic.a import A\nB = 2\n",
        "c.py": "C = 3\n",
    })
    result = _import_each(tmp_path / "cyclic")
    assert sorted(result["failed"]) == ["cyclic.a", "cyclic.b"]
    assert "ImportError" in result["failed"]["cyclic.a"]
    assert result["imported"] == 2


def test_no_import_cycle_between_modules_or_layers():
    edges, _ = mg.scan()
    assert mg.cycles(edges) == []
    layers = {}
    for (a, b) in mg.package_edges(edges):
        layers.setdefault(a, set()).add(b)
    assert mg.cycles(layers) == []


def test_no_import_points_up_the_layer_order():
    edges, _ = mg.scan()
    known = set(mg.layer_rank())
    assert {mg.layer_of(m) for m in edges} <= known, "a layer missing from module_graph.LAYERS"
    assert mg.upward(edges) == []


def test_function_local_imports_say_why():
    _, local = mg.scan()
    bare = [f"{m}:{line} {name}" for m, line, name, comment in local if not mg._has_reason(comment)]
    assert bare == [], "function-local imports without a reason comment (or move them up):\n" \
        + "\n".join(bare)


def test_layer_order_matches_the_module_docstring():
    doc = mg.__doc__
    positions = [re.search(rf"\n    {names[0]}[ ,]", doc).start() for names in mg.LAYERS[:-1]]
    assert positions == sorted(positions)


# Negative controls: the checkers fail where they must.

def test_cycles_finds_a_cycle_and_passes_a_tree():
    assert mg.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert mg.cycles({"a": {"a"}}) == [["a"]]
    assert mg.cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_upward_finds_an_import_up_the_order():
    layers = (("low",), ("mid",), ("high",))
    edges = {"p.high.x": {"p.low.y"}, "p.low.y": {"p.mid.z"}, "p.mid.z": set()}
    assert mg.upward(edges, layers, package="p") == [("p.low.y", "p.mid.z")]
    assert mg.upward({"p.other.a": {"p.low.y"}}, layers, package="p") == [("p.other.a", "p.low.y")]


def _write(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_scan_sees_cycles_and_upward_imports_in_source(tmp_path):
    pkg = tmp_path / mg.PACKAGE
    _write(pkg, {
        "__init__.py": "",
        "specs.py": "from tf_fusedemb.layers import thing\n",           # upward
        "layers/__init__.py": "from .thing import X\n",
        "layers/thing.py": "from tf_fusedemb.layers import other\nX = 1\n",
        "layers/other.py": "import tf_fusedemb.layers.thing\n",         # cycle thing <-> other
        "models/__init__.py": "",
        "models/m.py": ("import os\n\ndef f():\n"
                        "    from tf_fusedemb.layers import thing  # a reason\n"
                        "    import os.path  # noqa: F401\n"     # a run shares its reason
                        "    x = 1\n"
                        "    import json\n"),
    })
    edges, local = mg.scan(root=str(pkg))
    assert edges["tf_fusedemb.specs"] == {"tf_fusedemb.layers", "tf_fusedemb.layers.thing"}
    assert mg.cycles(edges) == [["tf_fusedemb.layers.other", "tf_fusedemb.layers.thing"]]
    assert ("tf_fusedemb.specs", "tf_fusedemb.layers") in mg.upward(edges)
    # Function-local imports are no edges (they run later) but are counted, with comments.
    assert edges["tf_fusedemb.models.m"] == set()
    assert [(m, n, mg._has_reason(c)) for m, _, n, c in local] == [
        ("tf_fusedemb.models.m", "tf_fusedemb.layers", True),
        ("tf_fusedemb.models.m", "os.path", True),
        ("tf_fusedemb.models.m", "json", False)]
    with_local, _ = mg.scan(root=str(pkg), with_local=True)
    assert with_local["tf_fusedemb.models.m"] == {"tf_fusedemb.layers", "tf_fusedemb.layers.thing"}


def test_has_reason_ignores_bare_directives():
    assert not mg._has_reason("pylint: disable=import-outside-toplevel")
    assert not mg._has_reason("noqa: F401  pylint: disable=unused-import,import-outside-toplevel")
    assert not mg._has_reason("type: ignore[import]")
    assert mg._has_reason("optional: TFRA  pylint: disable=import-outside-toplevel")
    assert mg._has_reason("pylint: disable=import-outside-toplevel  (a Horovod dependency)")
