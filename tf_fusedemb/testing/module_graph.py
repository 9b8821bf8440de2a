"""The import graph of tf_fusedemb, read from the source with ``ast`` (nothing is imported).

Command form (stdlib only; prints the package-level graph, cycles, upward imports and the
count of function-local imports)::

    python -m tf_fusedemb.testing.module_graph [--modules] [--local] [--with-local] [--json]

Layers of the package, bottom to top (an import may point only to its own layer or a lower
one; ``tests/test_layering.py`` enforces it)::

    quiet       environment defaults and output filters (imports nothing of the package)
    specs       frozen, validated dataclasses; the fusion planner
    ops         the custom-op library, its wrappers and pure-TF references
    data        Criteo / MovieLens / Avazu readers, synthetic data with a real profile
    comm        Horovod collectives, topology, counters, cost model, bounded-lag alltoallv
    storage     per-rank shards of the fused groups behind one backend interface
    layers      Keras layers: FusedEmbedding, its lookup context and exchanges
    training    the one training-step core, loss, replicas, loop, sharded checkpoints
    pipeline    tf.data builders, sample clustering, dual-buffer / micro-batch schedules
    inference   SavedModel export, bounded-lag distributed inference
    models      FusedModel (fit through the step core), fuse_model, DLRM, DCN-v2, sequence
    keras3      the Keras 3 facade: the Keras 3 FusedEmbedding and the optimizer wrapper
    testing     emulated multi-host cluster, mpirun launcher, DistributedTestCase, this graph
    benchmarks  ``python -m tf_fusedemb.benchmarks.<name>``
    job         the main job's factory of data and models by name (for train.py, serve.py)
    train, serve  the commands
    tf_fusedemb (the package ``__init__``): the facade; it imports nothing of the package at import time

Where this differs from DESIGN.md's list, the code decides: ``data`` needs only ``ops``
(hashing) and ``models`` use its Criteo column names, so it sits low; ``training`` sits
below ``pipeline`` (a pipelined step is a schedule of the one step core) and below
``models`` and ``inference`` (``FusedModel.train_step`` is the step core's; sharded inference
restores training checkpoints); ``testing`` (the launchers) sits above the library and
below ``benchmarks``, which launch ranks through it.

Edges are the imports executed when a module is imported: statements at module level
(including under ``if``/``try`` and in class bodies), not those inside functions. Importing
``a.b.c`` from outside ``a.b`` also runs ``a.b``'s ``__init__``: that edge is added too.
"""
import argparse
import ast
import json
import os
import re
import sys
from typing import Dict, Set
from collections import defaultdict

PACKAGE = "tf_fusedemb"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Bottom to top. Names in one tuple form one layer (they may import each other).
LAYERS = (("quiet",), ("specs",), ("ops",), ("data",), ("comm",), ("storage",), ("layers",),
          ("training",), ("pipeline",), ("inference",), ("models",), ("keras3",), ("testing",),
          ("benchmarks",),
          ("job",), ("train", "serve"), (PACKAGE,))


def layer_rank(layers=LAYERS):
    """Maps each layer name to its height (0 = bottom)."""
    return {name: i for i, names in enumerate(layers) for name in names}


def module_files(root=ROOT, package=PACKAGE):
    """{dotted module name: path} of every .py file of the package."""
    out = {}
    base = os.path.dirname(root)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and
                             os.path.exists(os.path.join(dirpath, d, "__init__.py")))
        for f in sorted(filenames):
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), base)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = os.path.join(dirpath, f)
    assert package in out, root
    return out


def layer_of(module, package=PACKAGE):
    """The layer name of a dotted module: its first component below the package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else package


def _is_package(module, files):
    return files[module].endswith("__init__.py")


def _resolve_from(node, module, files):
    """Absolute base module of a ``from X import ...`` statement."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    if not _is_package(module, files):
        parts = parts[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _targets(node, module, files):
    """Package modules an import statement names (the module itself, not its parents)."""
    out = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name:
                out.append(name)
    else:
        base = _resolve_from(node, module, files)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in files:
                out.append(sub)
            elif base in files:
                out.append(base)
    return [t for t in out if t == PACKAGE or t.startswith(PACKAGE + ".")]


class _Walker(ast.NodeVisitor):
    """Collects (import node, inside a function) for every import statement."""

    def __init__(self):
        self.found = []
        self._depth = 0

    def _function(self, node):
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node):
        self.found.append((node, self._depth > 0))

    visit_ImportFrom = visit_Import


def _imported_names(node):
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return [("." * node.level) + (node.module or "")]


def scan(root=ROOT, package=PACKAGE, with_local=False):
    """Reads every module. Returns (edges, local): edges {module: {module it imports at import
    time}} (with ``with_local``, also those its functions import); local [(module, line,
    imported name, comment)] for each function-local import."""
    files = module_files(root, package)
    edges: Dict[str, Set[str]] = {m: set() for m in files}
    local = []
    for module, path in files.items():
        with open(path, encoding="utf-8") as f:
            source = f.read()
        lines = source.splitlines()
        walker = _Walker()
        walker.visit(ast.parse(source, filename=path))
        previous = None  # (the function-local import just before, its comment)
        for node, in_function in walker.found:
            if in_function:
                comment = _comment(lines, node)
                # A run of imports, one right after the other, shares its first one's reason.
                if previous and previous[0].end_lineno == node.lineno - 1 and \
                        not _has_reason(comment):
                    comment = previous[1]
                previous = (node, comment)
                for name in _imported_names(node):
                    local.append((module, node.lineno, name, comment))
                if not with_local:
                    continue
            for target in _targets(node, module, files):
                # Importing a.b.c runs a.b's __init__ first, unless the importer is inside a.b
                # (then a.b is already being imported).
                parts = target.split(".")
                for i in range(2, len(parts) + 1):
                    dep = ".".join(parts[:i])
                    if dep != module and not (module + ".").startswith(dep + "."):
                        edges[module].add(dep)
    return edges, local


def package_edges(edges, package=PACKAGE):
    """{(layer a, layer b): [module edges]} between different layers."""
    out = defaultdict(list)
    for a, targets in edges.items():
        for b in targets:
            la, lb = layer_of(a, package), layer_of(b, package)
            if la != lb:
                out[(la, lb)].append((a, b))
    return dict(out)


def cycles(edges):
    """Strongly connected components of more than one node (or a self-loop), each sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]
    nodes = sorted(set(edges) | {b for t in edges.values() for b in t})

    def strongconnect(v):
        # Iterative Tarjan (the graph may be deep enough for the recursion limit).
        work = [(v, iter(sorted(edges.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    advanced = True
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1 or node in edges.get(node, ()):
                    out.append(sorted(comp))

    for v in nodes:
        if v not in index:
            strongconnect(v)
    return sorted(out)


def upward(edges, layers=LAYERS, package=PACKAGE):
    """Module edges that point to a higher layer: [(module, imported module)]. A layer name
    missing from ``layers`` is reported as an edge to/from "?"."""
    rank = layer_rank(layers)
    out = []
    for a, targets in sorted(edges.items()):
        for b in sorted(targets):
            la, lb = layer_of(a, package), layer_of(b, package)
            if la not in rank or lb not in rank:
                out.append((a, b))
            elif rank[lb] > rank[la]:
                out.append((a, b))
    return out


def report(root=ROOT, with_local=False):
    edges, local = scan(root, with_local=with_local)
    pkg = package_edges(edges)
    return {
        "with_function_local_edges": with_local,
        "modules": len(edges),
        "module_edges": sum(len(t) for t in edges.values()),
        "package_edges": {f"{a} -> {b}": len(v) for (a, b), v in sorted(pkg.items())},
        "module_cycles": cycles(edges),
        "package_cycles": cycles({a: {b for (x, b) in pkg if x == a} for (a, _) in pkg}),
        "upward_imports": [f"{a} -> {b}" for a, b in upward(edges)],
        "function_local_imports": len(local),
        "function_local_without_reason": sum(1 for *_, c in local if not _has_reason(c)),
        "function_local": [f"{m}:{line} {name}  # {c}" for m, line, name, c in local],
        "graph": {m: sorted(t) for m, t in sorted(edges.items())},
    }


def _comment(lines, node):
    """The comments of an import statement: on its own lines and in the comment lines
    just above it."""
    text = [line.partition("#")[2] for line in lines[node.lineno - 1:node.end_lineno]]
    above = node.lineno - 2
    while above >= 0 and lines[above].strip().startswith("#"):
        text.insert(0, lines[above].strip()[1:])
        above -= 1
    return " ".join(t.strip() for t in text if t.strip())


_DIRECTIVE = re.compile(r"(pylint:\s*disable=[\w,-]+|noqa(:\s*[A-Z]+\d+(,\s*[A-Z]+\d+)*)?|"
                        r"type:\s*ignore(\[[\w,-]+\])?)")


def _has_reason(comment):
    """A comment that says more than pylint/noqa/type directives."""
    return bool(_DIRECTIVE.sub("", comment).strip(" #;:()"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modules", action="store_true", help="print every module's imports")
    p.add_argument("--local", action="store_true", help="list the function-local imports")
    p.add_argument("--with-local", action="store_true",
                   help="count function-local imports as edges too (the cycles they hide)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    args = p.parse_args(argv)
    r = report(with_local=args.with_local)
    if args.json:
        if not args.modules:
            r.pop("graph")
        if not args.local:
            r.pop("function_local")
        print(json.dumps(r, indent=1))
        return 0
    kind = "import-time + function-local" if args.with_local else "import-time"
    print(f"{r['modules']} modules, {r['module_edges']} {kind} edges")
    print("package-level edges (count of module edges):")
    for k, v in r["package_edges"].items():
        print(f"  {k}  ({v})")
    print(f"module cycles: {len(r['module_cycles'])}")
    for c in r["module_cycles"]:
        print("  " + " <-> ".join(c))
    print(f"package cycles: {len(r['package_cycles'])}")
    for c in r["package_cycles"]:
        print("  " + " <-> ".join(c))
    print(f"upward imports: {len(r['upward_imports'])}")
    for e in r["upward_imports"]:
        print("  " + e)
    print(f"function-local imports: {r['function_local_imports']} "
          f"({r['function_local_without_reason']} without a reason comment)")
    if args.local:
        for e in r["function_local"]:
            print("  " + e)
    if args.modules:
        for m, t in r["graph"].items():
            print(f"{m}: {', '.join(t)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
