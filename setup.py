"""Build and install tf_fusedemb.

The custom ops in custom_ops/*.cc are compiled into ONE library,
tf_fusedemb/_fusedemb_ops-tfX.Y.so, against the TensorFlow X.Y installed in the running Python
(its tf.sysconfig flags). The name carries TensorFlow's version because a library built for
one version does not load in another, and the two stacks (docs/guide/stacks.md) share this
work tree; their objects are kept apart for the same reason. Install without build
isolation so that TensorFlow is the one that will load the library:  pip install --no-build-isolation -e .
Set TF_FUSEDEMB_JOBS to change the number of parallel compile jobs (default: CPU count).

A library built once is kept in a cache of this machine ($XDG_CACHE_HOME or ~/.cache, under
tf_fusedemb/ops) under a key of everything the build reads: the sources and headers of
custom_ops/, this file, the compiler's version, TensorFlow's version and flags, RocksDB's
version. A later build with the same key (a fresh clone, CI, the other checkout) copies it
instead of compiling for a minute; any change to what it reads compiles anew.
"""
import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

LIB_NAME = "tf_fusedemb._fusedemb_ops"
SOURCES = sorted(glob.glob(os.path.join("custom_ops", "*.cc")))
PCH_HEADER = "tf_framework.h"  # precompiled once per build (build_extension)


def _tf_flags():
    try:
        import tensorflow as tf
    except ImportError as e:  # pragma: no cover - build-time message
        raise RuntimeError(
            "tf_fusedemb compiles its ops against the installed TensorFlow; install "
            "a stack first (`make setup`) and build with --no-build-isolation") from e
    return tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()


def _ops_cache_dir():
    """Where built libraries are kept ($XDG_CACHE_HOME or ~/.cache, then tf_fusedemb/ops)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "tf_fusedemb", "ops")


def _build_key(cxx, compile_flags, link_flags):
    """A hash of everything the library's build reads. TensorFlow's flags name its folder
    in this checkout's venv: that folder is left out, its version stands for it."""
    import tensorflow as tf
    site = os.path.dirname(os.path.dirname(tf.__file__))
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join("custom_ops", "*"))) + [__file__]:
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + b"\0" + f.read() + b"\0")
    compiler = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True)
    flags = [f.replace(site, "SITE") for f in compile_flags + link_flags]
    rocksdb = "/usr/include/rocksdb/version.h"
    digest.update(repr((compiler.stdout, flags, tf.__version__, tf.version.GIT_VERSION,
                        open(rocksdb).read() if os.path.exists(rocksdb) else None)).encode())
    return digest.hexdigest()[:16]


def _tf_tag():
    """"tf2.16", "tf2.21", ...: the TensorFlow the library is built for (its file name)."""
    import tensorflow as tf
    return "tf" + ".".join(tf.__version__.split(".")[:2])


class BuildTfOps(build_ext):
    """Compiles the op library with g++ and TensorFlow's own flags (no Bazel needed)."""

    def get_ext_filename(self, ext_name):
        # No Python ABI tag: the library is loaded by TF, not imported; TF's version instead
        # (tf_fusedemb/ops/_loader.py loads the one of the running TensorFlow).
        return os.path.join(*ext_name.split(".")) + f"-{_tf_tag()}.so"

    def build_extension(self, ext):
        compile_flags, link_flags = _tf_flags()
        out = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        obj_dir = os.path.join(self.build_temp, "custom_ops-" + _tf_tag())
        os.makedirs(obj_dir, exist_ok=True)
        cxx = os.environ.get("CXX", "g++")
        cached = os.path.join(_ops_cache_dir(), _build_key(cxx, compile_flags, link_flags),
                              os.path.basename(out))
        if os.path.exists(cached):
            shutil.copyfile(cached, out)
            print(f"op library: copied the one built earlier ({cached})")
            return
        self._compile(ext, out, obj_dir, cxx, compile_flags, link_flags)
        _keep(out, cached)

    def _compile(self, ext, out, obj_dir, cxx, compile_flags, link_flags):
        # -DNDEBUG as TensorFlow's own release build: without it the inlined absl hash
        # tables run their debug checks (AssertIsFull and the like) on every probe.
        base = [cxx, "-fPIC", "-O3", "-DNDEBUG", "-std=c++17", "-Wall", "-Wno-sign-compare",
                "-Icustom_ops"] + compile_flags

        def outdated(target, src):
            return not (os.path.exists(target) and os.path.getmtime(target) >= max(
                os.path.getmtime(p) for p in [src] + glob.glob("custom_ops/*.h")))

        # The TensorFlow headers most sources share, parsed once (custom_ops/tf_framework.h):
        # g++ finds the .gch in obj_dir before the header in custom_ops/ and, should the
        # .gch not fit the flags, reads the header instead (the same code either way).
        pch = os.path.join(obj_dir, PCH_HEADER + ".gch")
        if outdated(pch, os.path.join("custom_ops", PCH_HEADER)):
            subprocess.run(base + ["-x", "c++-header", os.path.join("custom_ops", PCH_HEADER),
                                   "-o", pch], check=True)

        def compile_one(src):
            obj = os.path.join(obj_dir, os.path.basename(src)[:-3] + ".o")
            if outdated(obj, src):
                with open(src) as f:
                    uses_tf = '#include "tensorflow/core/framework/' in f.read()
                first = ["-I" + obj_dir, "-include", PCH_HEADER] if uses_tf else []
                subprocess.run(base[:1] + first + base[1:] + ["-c", src, "-o", obj], check=True)
            return obj

        jobs = int(os.environ.get("TF_FUSEDEMB_JOBS", os.cpu_count() or 2))
        with ThreadPoolExecutor(jobs) as pool:
            objs = list(pool.map(compile_one, ext.sources))
        # RocksDB: the engine checkpoints' format (custom_ops/rocksdb_checkpoint.cc); the
        # distribution's librocksdb-dev, installed by `make rocksdb-lib`.
        subprocess.run([cxx, "-shared", "-o", out] + objs + link_flags + ["-lrocksdb"],
                       check=True)


def _keep(built, cached):
    """Copies ``built`` into the cache whole or not at all (a temporary name, then a rename);
    a cache that cannot be written leaves the build as it is."""
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(cached))
        os.close(fd)
        shutil.copyfile(built, tmp)
        os.replace(tmp, cached)
    except OSError as e:
        print(f"op library: not cached ({e})")


# Imported (tests/test_ops_build_cache.py) it builds nothing; pip runs it as __main__.
if __name__ == "__main__":
    setup(
        name="tf_fusedemb",
        version="0.1.0",
        description="Fused, Horovod-sharded embedding tables for TensorFlow recommenders",
        long_description=open("README.md").read() if os.path.exists("README.md") else "",
        long_description_content_type="text/markdown",
        license="Apache-2.0",
        python_requires=">=3.9",
        packages=find_packages(include=["tf_fusedemb", "tf_fusedemb.*"]),
        package_data={"tf_fusedemb": ["_fusedemb_ops-tf*.so"], "tf_fusedemb.data": ["*.json"]},
        ext_modules=[Extension(LIB_NAME, sources=SOURCES)],
        cmdclass={"build_ext": BuildTfOps},
        # The two stacks of docs/guide/stacks.md (requirements.txt, requirements-tf216.txt).
        install_requires=["tensorflow>=2.16.2,<2.22", "tf_keras>=2.16,<2.22", "numpy>=1.26,<2"],
        extras_require={"tfra": ["tensorflow-recommenders-addons==0.8.1"],
                        "test": ["pytest>=7", "pytest-timeout>=2.1"]},
        zip_safe=False,
    )
