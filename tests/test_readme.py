"""Every fenced code block of README.md and of the documentation site's pages (docs/*.md,
docs/guide/*.md; the API reference has none) runs as written, so the README and the
guides cannot drift from the code.

* ``python`` blocks run as they are, each in its own process; blocks whose first line says
  ``# continues the "SECTION" example`` run together, after the first python block of that
  section of the same page, in one process (as a reader runs them in one session). They
  are written with short settings already.
* ``bash`` blocks run as written where that fits CI time; a long one is listed in SHELL
  with the short-settings equivalent the test runs instead (each replacement is asserted
  to apply to the block's text), or with the reason it is not run at all. A block that is
  neither run nor listed fails the test, as does a listed block that is no longer on any
  page.
* The pages run in order, README first: a guide's command may use what the README's
  ``make train`` wrote (``runs/main/ckpt``).

Everything runs in a scratch copy of the checkout's layout (symlinks: the repository's
files, ``.venv``, and ``../shared`` beside it), so ``runs/``, ``predictions.tsv`` and the
like land in the scratch directory. The environment is a newcomer's: no
``TF_CPP_MIN_LOG_LEVEL``/``TF_USE_LEGACY_KERAS`` from this suite, so every block's output is
also checked for TensorFlow's CUDA-factory error lines, which the project's commands and
``tf_fusedemb.quiet.install()`` must drop. Two to four minutes of the suite on 2 cores.
"""
import dataclasses
import os
import re
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

import pytest

from conftest import DEFAULT_STACK, REPO_ROOT, SHARED_DATA, STACK, STACK_RUN_DIR, STACK_VENV

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
# The pages whose blocks run: the README, then the site's pages (reference pages hold only
# mkdocstrings directives; docs/timelines and docs/tfra_cuckoo_race are records, not pages).
PAGES = [README] + sorted(DOCS.glob("*.md")) + sorted((DOCS / "guide").glob("*.md"))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.S | re.M)
HEADING = re.compile(r"^(#{2,3}) (.+)$", re.M)
CONTINUES = re.compile(r'^# continues the "([^"]+)" example')
NOISE = "Unable to register cu"  # TF 2.16's CUDA-factory lines (tf_fusedemb/quiet.py)
BLOCK_TIMEOUT_S = 300

TINY_TRAIN = "--steps 4 --batch-size 64 --rows 2048 --eval-rows 512"


@dataclasses.dataclass
class Block:
    lang: str
    text: str
    section: str
    line: int
    page: str = "README.md"

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line} ({self.section!r}, {self.lang or 'no language'})"


def page_blocks(path) -> List[Block]:
    """The fenced blocks of one page, each with the heading (## or ###) above it."""
    text = path.read_text()
    page = str(path.relative_to(REPO_ROOT))
    headings = [(m.start(), m.group(2).strip()) for m in HEADING.finditer(text)]
    blocks = []
    for m in FENCE.finditer(text):
        above = [h for pos, h in headings if pos < m.start()]
        blocks.append(Block(m.group(1), m.group(2), above[-1] if above else "(top)",
                            text[:m.start()].count("\n") + 1, page))
    return blocks


def readme_blocks() -> List[Block]:
    return page_blocks(README)


def all_blocks() -> List[Block]:
    """Every page's blocks, README first (see the module doc)."""
    return [b for path in PAGES for b in page_blocks(path)]


def _sub(text: str, *pairs: Tuple[str, str]) -> str:
    """``text`` with each (old, new) replaced; each ``old`` must occur (drift fails)."""
    for old, new in pairs:
        assert old in text, f"the README block no longer contains {old!r}:\n{text}"
        text = text.replace(old, new)
    return text


# What each bash block becomes: ("run",) as written, ("substitute", fn(text) -> the
# commands to run) with the reason, or ("skip", reason). Keyed by the block's first line.
SHELL: Dict[str, tuple] = {
    "make train   # set up (iproute2 and Open MPI where missing, .venv with the pinned stack, "
    "Horovod built with Gloo, op library), run the main job on 2 workers": (
        "substitute",
        lambda text: [_sub(text.splitlines()[0], (
            "make train", f"make -o setup train FRESH=1 TRAIN_ARGS='{TINY_TRAIN}'"))],
        "`make train`: the main job with 4 steps of 64 rows (the default is 300 of 1024, "
        "90 s); setup is the suite's own (`-o setup`). `make test` is not run: it is the "
        "suite that runs this test."),
    "TF_CPP_MIN_LOG_LEVEL=3 .venv/bin/horovodrun -np 2 --gloo -H localhost:2 \\": (
        "substitute",
        lambda text: [_sub(text, ("--steps-per-epoch 200", "--steps-per-epoch 3 --test-steps 2 "
                                  "--batch-size 64 --embedding-size 8"))],
        "3 steps of 64 ratings instead of 200 of 256"),
    ".venv/bin/python -m tf_fusedemb.testing.cluster --hosts 2 --ranks-per-host 2 "
    "--link-mbit 1000 \\": (
        "substitute",
        lambda text: [
            _sub(text.splitlines()[0] + "\n" + text.splitlines()[1],
                 ("--ranks-per-host 2", "--ranks-per-host 1"),
                 ("--steps 100", "--steps 3 --batch-size 64 --rows 2048 --eval-rows 512")),
            _sub(text.splitlines()[2].split("#")[0].strip(),
                 ("make train HOSTS=2", "make -n -o setup train HOSTS=2"))],
        "needs root (skipped where the cluster cannot be built): 2 hosts x 1 rank for 3 "
        "steps; `make train HOSTS=2` as a dry run (the same launcher as the line above; "
        "tests/test_multihost.py runs the main job on 2 x 2 hosts)"),
    "mpirun --allow-run-as-root --oversubscribe -np 4 .venv/bin/python -m tf_fusedemb.serve \\": (
        "substitute",
        lambda text: [_sub(text, ("-np 4", "-np 2"),
                           ("--output predictions.tsv", "--output predictions.tsv "
                                                        "--max-batches 3"))],
        "2 ranks on 2 cores, 3 batches; serves the checkpoint of the `make train` block"),
    ".venv/bin/horovodrun -np 4 --gloo -H localhost:4 .venv/bin/python -m tf_fusedemb.train \\": (
        "substitute",
        lambda text: [_sub(text, ("-np 4 --gloo -H localhost:4", "-np 2 --gloo -H localhost:2"),
                           ("--export-only", "--export-only --eval-rows 512"))],
        "2 ranks on 2 cores, 512 held-out rows; exports the checkpoint of the `make train` "
        "block"),
    ".venv/bin/python -m tf_fusedemb.testing.mpirun --hosts 2 --ranks-per-host 1 "
    "--link-mbit 1000 -- \\": (
        "skip",
        "tests/test_distributed_inference_serve.py runs this command (2 emulated hosts x 1 "
        "rank, needs root) and checks its predictions against the single-host SavedModel"),
    ".venv/bin/python -m tf_fusedemb.benchmarks.ops --json": (
        "substitute",
        lambda text: [_sub(text.splitlines()[0], (
            "--json", "--json --batch-size 512 --small-batch 64 --repeats 2 --iterations 2 "
                      "--num-ranks 2"))],
        "the ops benchmark with 2 repeats of 2 iterations; the lookup and pipeline lines "
        "take minutes: tests/test_benchmark_lookup.py and tests/test_benchmark_pipeline.py "
        "run them with short settings (the pipeline one on emulated hosts where possible)"),
    "make train-beyond-memory WIDE_IDS=5000000 WIDE_BUDGET_MB= WIDE_LIMIT_MB=": (
        "substitute",
        lambda text: [_sub(text, ("make train-beyond-memory WIDE_IDS=5000000",
                                  "make -o setup train-beyond-memory WIDE_IDS=8192 WIDE_BATCH=256"))],
        "the same target at 8,192 IDs in batches of 256 (17 steps on 2 workers); setup is "
        "the suite's own (`-o setup`); tests/test_main_job.py trains --wide-ids under a "
        "budget against the all-DRAM job, and tests/test_memory_limit.py runs the cgroup"),
    ".venv/bin/python -m tf_fusedemb.testing.module_graph --local": ("run",),
    "make test                 # TF 2.21: the whole suite less the tests marked `tfra`, then "
    "make test-tf216": (
        "skip",
        "the suite itself (CI runs `make test`) and the other stack's setup and suite (tens "
        "of minutes: the TF 2.16 venv and its Horovod build)"),
    "python -m tf_fusedemb.benchmarks.lookup --json --variants fused,fused_bf16 --profile": (
        "skip",
        "a benchmark of minutes: tests/test_benchmark_lookup.py runs it with --profile 2 and "
        "short settings, and checks the breakdown adds up to each step's time"),
    "TF_CPP_MIN_LOG_LEVEL=3 .venv/bin/horovodrun -np 2 --gloo -H localhost:2 env "
    "TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python train_it.py": (
        "skip",
        "train_it.py is the reader's own script (the README's complete example runs above in "
        "one process); the MovieLens block runs the same horovodrun launcher on 2 ranks"),
    "python3.12 -m venv .venv && .venv/bin/pip install -r requirements.txt cmake": (
        "skip",
        "`make setup` performs these steps (CI runs it before the suite); building Horovod "
        "from source takes minutes"),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A scratch checkout: the repository's entries as symlinks (runs/ excluded), and
    ``../shared`` beside it when the real data is present."""
    root = tmp_path_factory.mktemp("readme")
    work = root / "repo"
    work.mkdir()
    for entry in REPO_ROOT.iterdir():
        if entry.name not in ("runs", ".git", ".pytest_cache", ".hypothesis", ".mypy_cache"):
            (work / entry.name).symlink_to(entry)
    if SHARED_DATA.is_dir():
        (root / "shared").symlink_to(SHARED_DATA.parent)
    return work


def newcomer_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TF_CPP", "TF_USE_LEGACY", "HOROVOD", "OMPI", "PMI"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run(cmd, cwd, shell=False, timeout=BLOCK_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, shell=shell, executable="/bin/bash" if shell else None,
                              env=newcomer_env(), capture_output=True, text=True,
                              timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"timed out after {timeout}s: {cmd}") from e


def continued(block: Block) -> Optional[str]:
    """The section whose example ``block`` continues, or None."""
    m = CONTINUES.match(block.text.splitlines()[0] if block.text.strip() else "")
    return m.group(1) if m else None


def python_source(block: Block, blocks: List[Block]) -> str:
    """What runs for ``block``: the block itself, or, for the first block continuing a
    section's example, that example followed by every block continuing it (in README
    order, as a reader runs them in one session); "" for the later ones (already run)."""
    section = continued(block)
    if section is None:
        return block.text
    base = [b for b in blocks if b.lang == "python" and b.page == block.page
            and b.section == section]
    assert base, f"{block.where} continues section {section!r}, which has no python block"
    assert continued(base[0]) is None, "one level of continuation only"
    followers = [b for b in blocks if b.lang == "python" and b.page == block.page
                 and continued(b) == section]
    if block is not followers[0]:
        return ""
    return "\n".join([base[0].text] + [b.text for b in followers])


def on_this_stack(command: str) -> str:
    """The README's shell command, written for the default stack (.venv, runs/main), as it
    reads on the stack running the tests (docs/guide/stacks.md): its venv, `make` with its
    STACK, its run directory. Unchanged on the default stack."""
    if STACK == DEFAULT_STACK:
        return command
    command = re.sub(r"(?<![\w.-])\.venv/", STACK_VENV + "/", command)
    command = re.sub(r"\bmake ", f"make STACK={STACK} ", command)
    return command.replace("runs/main/", STACK_RUN_DIR + "/")


def check_output(what: str, out: subprocess.CompletedProcess) -> str:
    text = out.stdout + out.stderr
    assert out.returncode == 0, f"{what} failed ({out.returncode}):\n{text[-5000:]}"
    assert NOISE not in text, f"{what} printed TensorFlow's CUDA-factory lines:\n{text[-3000:]}"
    return text


def test_every_block_is_run_or_listed():
    """Cheap and first: a new or changed bash block must be run or listed, and every listed
    block must still be on a page."""
    assert len([b for b in readme_blocks() if b.lang == "python"]) >= 1
    blocks = all_blocks()
    assert len([b for b in blocks if b.lang == "python"]) >= 12
    firsts = {b.text.splitlines()[0] for b in blocks if b.lang in ("bash", "sh", "")}
    unknown = [b.where + ": " + b.text.splitlines()[0] for b in blocks
               if b.lang not in ("python", "bash", "sh", "")]
    assert not unknown, f"blocks of a language this test cannot run: {unknown}"
    firsts_per_page: Dict[str, List[str]] = {}
    for b in blocks:
        if b.lang != "python":
            firsts_per_page.setdefault(b.text.splitlines()[0], []).append(b.where)
    twice = {k: v for k, v in firsts_per_page.items() if len(v) > 1}
    assert not twice, f"bash blocks starting with the same line (SHELL keys them): {twice}"
    unlisted = [b.where + ": " + b.text.splitlines()[0] for b in blocks
                if b.lang != "python" and b.text.splitlines()[0] not in SHELL]
    assert not unlisted, ("bash blocks neither run nor listed in tests/test_readme.py's "
                          f"SHELL: {unlisted}")
    stale = [k for k in SHELL if k not in firsts]
    assert not stale, f"listed in SHELL but on no page: {stale}"


def _cluster_unavailable() -> Optional[str]:
    from tf_fusedemb.testing.cluster import ClusterUnavailable, EmulatedCluster
    try:
        with EmulatedCluster(hosts=2, ranks_per_host=1):
            return None
    except ClusterUnavailable as e:
        return str(e)


@pytest.mark.timeout(2400)
def test_readme_and_guides_code_blocks_run(workdir):
    blocks = all_blocks()
    cluster_reason = _cluster_unavailable()
    ran, skipped, timings = [], [], []
    for block in blocks:
        start = time.monotonic()
        first = block.text.splitlines()[0]
        needs_cluster = "EmulatedCluster" in block.text or "testing.cluster --hosts" in block.text
        if needs_cluster and cluster_reason:
            skipped.append(f"{block.where}: emulated cluster unavailable ({cluster_reason})")
            continue
        if "../shared/data" in block.text and not SHARED_DATA.is_dir():
            skipped.append(f"{block.where}: {SHARED_DATA} absent")
            continue
        if block.lang == "python":
            source = python_source(block, blocks)
            if source:
                script = workdir / f"readme_block_{block.line}.py"
                script.write_text(source)
                check_output(block.where, run([sys.executable, str(script)], workdir))
            ran.append(block.where + ("" if source else " (with the block it continues)"))
        else:
            kind, *rest = SHELL[first]
            if kind == "skip":
                skipped.append(f"{block.where}: {rest[0]}")
                continue
            commands = rest[0](block.text) if kind == "substitute" else [block.text]
            for command in commands:
                text = check_output(f"{block.where}: {command}",
                                    run(on_this_stack(command), workdir, shell=True))
                _check_block_result(first, command, text, workdir)
            ran.append(block.where + (" (short settings)" if kind == "substitute" else ""))
        timings.append((time.monotonic() - start, block.where))
        print(f"{block.where}: {timings[-1][0]:.0f} s", flush=True)
    print("\nran:\n  " + "\n  ".join(ran) + "\nnot run:\n  " + "\n  ".join(skipped))
    print("slowest: " + ", ".join(f"{w} {t:.0f}s" for t, w in sorted(timings)[::-1][:5]))
    assert len(ran) >= 14, (ran, skipped)


def _check_block_result(first: str, command: str, text: str, workdir) -> None:
    """What a few blocks must show beyond exiting 0 without noise."""
    if command.startswith("make -o setup train "):
        lines = [l for l in text.splitlines() if "step " in l and "/4" in l]
        assert lines and "samples/s" not in lines[0], \
            f"the first progress line shows a samples/s before any timed step: {lines[:2]}"
        assert "samples/s" in lines[-1] and "RESULT {" in text, text[-3000:]
        assert (workdir / STACK_RUN_DIR / "ckpt" / "latest").exists()
    if command.startswith("make -n -o setup train HOSTS=2"):
        assert "tf_fusedemb.testing.cluster --hosts 2 --ranks-per-host 1" in text, text
    if "tf_fusedemb.serve" in command:
        assert "RESULT {" in text and (workdir / "predictions.tsv").exists(), text[-3000:]
