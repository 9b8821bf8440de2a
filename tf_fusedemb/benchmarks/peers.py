"""The lookup benchmark's DLRM against TorchRec's CPU path, on the same batches.

    make peers-env                                   # TorchRec's own virtual environment
    python -m tf_fusedemb.benchmarks.peers --json    # (or: make peers)

An optional benchmark, not part of CI: TorchRec needs torch and FBGEMM, which this package
does not depend on, so they live in their own environment (``.venv-peers``, pinned in
``requirements-peers.txt``; ``--peer-python`` names another).

The driver dumps the lookup benchmark's batches (``lookup_data``: the same synthetic rows,
the same per-rank slices) for TorchRec, each feature's IDs renumbered 0..V-1 so its table
holds exactly the rows the batches touch. Then, for ``--rounds`` rounds, it runs one after
another, each in fresh processes on ``--np`` ranks:

* our step: ``tf_fusedemb.benchmarks.lookup`` with its ``fused`` (float32) and
  ``fused_bf16`` (bf16 dense compute and row exchange) variants, which builds the same
  batches itself;
* TorchRec (``peers_worker``, under ``torchrun``, ``OMP_NUM_THREADS=1``: one thread per
  rank, TorchRec's best on CPU): table-wise and row-wise sharding, each in float32 and with
  its dense part under bf16 autocast.

Each run reports its median step time; the result gives each configuration's median over
the rounds and ``speedup_vs_torchrec_best`` (TorchRec's fastest configuration over our
fastest mode) and ``speedup_vs_torchrec_fp32`` (both float32: TorchRec's faster sharding
over ``fused``), and ``speedup_by_round``: both ratios of each round alone. The last line of stdout is one JSON object.
"""
import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, NamedTuple

import numpy as np

from tf_fusedemb.benchmarks import lookup_data, lookup_models, plots
from tf_fusedemb.benchmarks.launcher import PIN_MODULE

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_PEER_PYTHON = REPO_ROOT / ".venv-peers" / "bin" / "python"
WORKER = pathlib.Path(__file__).with_name("peers_worker.py")
OURS = ("fused", "fused_bf16")


class PeerConfig(NamedTuple):
    """One TorchRec configuration: its sharding and whether its dense part is bf16."""
    sharding: str
    bf16: bool

    @property
    def label(self) -> str:
        return f"torchrec_{self.sharding}" + ("_bf16" if self.bf16 else "")


PEER_CONFIGS = tuple(PeerConfig(s, b) for s in ("table_wise", "row_wise") for b in (False, True))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="our DLRM step against TorchRec's CPU path")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--np", type=int, default=2, help="ranks (one host)")
    parser.add_argument("--batch-size", type=int, default=4096, help="samples per rank")
    parser.add_argument("--num-batches", type=int, default=8, help="distinct global batches")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per run")
    parser.add_argument("--lr", type=float, default=0.05, help="Adagrad learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peer-python", default=str(DEFAULT_PEER_PYTHON),
                        help="the interpreter of the TorchRec environment")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="both sides' ranks run unpinned (default: each rank of either "
                             "side pinned to its share of the cores, as make train runs ours)")
    parser.add_argument("--plot", metavar="PATH", help="also write a PNG of the step times")
    args = parser.parse_args(argv)
    if min(args.np, args.batch_size, args.num_batches, args.rounds, args.steps) < 1:
        parser.error("--np, --batch-size, --num-batches, --rounds and --steps must be >= 1")
    return args


def check_peer_python(python: str) -> str:
    """``python``'s torch and torchrec versions; a clear error when it lacks them."""
    probe = ("import torch, torchrec, fbgemm_gpu; "
             "print(torch.__version__, getattr(torchrec, '__version__', '?'))")
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300)
    except OSError as e:
        raise SystemExit(f"peers: no TorchRec environment at {python} ({e.strerror}): run "
                         "`make peers-env`, or pass --peer-python") from None
    if out.returncode != 0:
        raise SystemExit(f"peers: {python} cannot import torch, torchrec and fbgemm_gpu "
                         f"(run `make peers-env`):\n{out.stderr[-2000:]}")
    return out.stdout.strip()


def dump_batches(args: argparse.Namespace, directory: str) -> Dict[str, int]:
    """Writes ``rank<R>.npz`` per rank (``b<t>_<feature>`` int64[B] renumbered IDs,
    ``b<t>_dense`` float32[B, 13], ``b<t>_label`` float32[B, 1], ``table_sizes``
    int64[26], and the model's shape, so the TorchRec worker builds the lookup
    benchmark's: ``features`` str[26], ``dim``, ``hidden`` int[layers]); returns
    {feature: table size}."""
    columns = lookup_data.synthetic_columns(args.batch_size, args.np, args.num_batches,
                                            args.seed)
    per_rank = [lookup_data.make_batches(columns, args.batch_size, args.np, r, args.num_batches)
                for r in range(args.np)]
    sizes: Dict[str, int] = {}
    renumbered: List[Dict[str, np.ndarray]] = [{} for _ in range(args.np)]
    for c in lookup_data.CATEGORICAL:
        ids = np.concatenate([x[c] for batches in per_rank for x, _ in batches])
        distinct, inverse = np.unique(ids, return_inverse=True)
        sizes[c] = len(distinct)
        parts = np.split(inverse.astype(np.int64), np.cumsum(
            [len(x[c]) for batches in per_rank for x, _ in batches])[:-1])
        for i, part in enumerate(parts):
            rank, t = divmod(i, args.num_batches)
            renumbered[rank][f"b{t}_{c}"] = part
    for rank, batches in enumerate(per_rank):
        arrays = renumbered[rank]
        for t, (x, y) in enumerate(batches):
            arrays[f"b{t}_dense"], arrays[f"b{t}_label"] = x["dense"], y
        np.savez(os.path.join(directory, f"rank{rank}.npz"), num_batches=args.num_batches,
                 table_sizes=np.array([sizes[c] for c in lookup_data.CATEGORICAL]),
                 features=np.array(lookup_data.CATEGORICAL), dim=lookup_models.DIM,
                 hidden=np.array(lookup_models.HIDDEN), **arrays)
    return sizes


def last_json(stdout: str, marker: str = "") -> dict:
    """The last line of ``stdout`` starting with ``marker``, parsed as JSON."""
    lines = [l for l in stdout.splitlines() if l.startswith(marker) and l.strip()]
    if not lines:
        raise RuntimeError(f"no result line{' ' + marker if marker else ''} in:\n{stdout[-3000:]}")
    return json.loads(lines[-1][len(marker):])


def run_ours(args: argparse.Namespace) -> Dict[str, float]:
    """One run of the lookup benchmark's fused variants: {variant: median step ms}."""
    cmd = [sys.executable, "-m", "tf_fusedemb.benchmarks.lookup", "--json", "--np", str(args.np),
           "--variants", ",".join(OURS), "--batch-size", str(args.batch_size),
           "--num-batches", str(args.num_batches), "--steps", str(args.steps), "--rounds", "1",
           "--warmup", str(args.warmup), "--lr", str(args.lr), "--seed", str(args.seed)]
    if not args.pin:
        cmd.append("--no-pin")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True)
    variants = last_json(out.stdout)["variants"]
    return {v: float(variants[v]["step_ms"]) for v in OURS}


def peer_command(args: argparse.Namespace, config: PeerConfig, batches: str) -> List[str]:
    """The torchrun command of one TorchRec run of ``config`` on the batches dumped in
    ``batches``. Pinned (``args.pin``), torchrun starts our pinning wrapper, which reads
    the rank's slot from torchrun's environment and runs the worker under taskset, as
    ``make train`` runs ours."""
    pin = ["--no-python", sys.executable, "-m", PIN_MODULE, args.peer_python] if args.pin else []
    return [args.peer_python, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(args.np), *pin, str(WORKER), "--batches", batches,
            "--sharding", config.sharding, "--warmup", str(args.warmup),
            "--steps", str(args.steps), "--lr", str(args.lr)] + (["--bf16"] if config.bf16 else [])


def run_peer(args: argparse.Namespace, config: PeerConfig, batches: str) -> float:
    """One TorchRec run of ``config``: its median step ms."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(peer_command(args, config, batches), capture_output=True, text=True,
                         timeout=1800, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{config.label} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return float(last_json(out.stdout, "PEER_RESULT ")["step_ms"])


def speedups(medians: Dict[str, float]) -> Dict[str, float]:
    """``speedup_vs_torchrec_best`` and ``speedup_vs_torchrec_fp32`` from median step ms."""
    peers = {c.label: medians[c.label] for c in PEER_CONFIGS}
    peers_fp32 = [medians[c.label] for c in PEER_CONFIGS if not c.bf16]
    return {"speedup_vs_torchrec_best": min(peers.values()) / min(medians[v] for v in OURS),
            "speedup_vs_torchrec_fp32": min(peers_fp32) / medians["fused"]}


def speedups_by_round(runs: Dict[str, List[float]]) -> List[Dict[str, float]]:
    """``speedups`` of each round alone (its runs' step ms, one per configuration): how
    much the ratio varies between rounds, beside the ratio of the medians."""
    rounds = min(len(v) for v in runs.values())
    return [speedups({k: v[r] for k, v in runs.items()}) for r in range(rounds)]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main(argv=None) -> int:
    args = parse_args(argv)
    versions = check_peer_python(args.peer_python)
    runs: Dict[str, List[float]] = {k: [] for k in OURS + tuple(c.label for c in PEER_CONFIGS)}
    with tempfile.TemporaryDirectory(prefix="fusedemb_peers_") as batches:
        table_sizes = dump_batches(args, batches)
        for r in range(args.rounds):
            for variant, ms in run_ours(args).items():
                runs[variant].append(ms)
            for config in PEER_CONFIGS:
                runs[config.label].append(run_peer(args, config, batches))
            print(f"peers: round {r + 1}/{args.rounds}: " + ", ".join(
                f"{k} {v[-1]:.1f} ms" for k, v in runs.items()), file=sys.stderr, flush=True)
    medians = {k: float(np.median(v)) for k, v in runs.items()}
    result = {"step_ms": medians, "runs_ms": runs, **speedups(medians),
              "speedup_by_round": speedups_by_round(runs),
              "samples_per_s": {k: args.np * args.batch_size * 1e3 / v for k, v in medians.items()},
              "environment": {"np": args.np, "batch_size_per_rank": args.batch_size,
                              "rounds": args.rounds, "steps_per_run": args.steps,
                              "pinned": args.pin,
                              "cpu": cpu_model(), "cpus": os.cpu_count(),
                              "torch_torchrec": versions,
                              "table_rows": int(sum(table_sizes.values())),
                              "date": time.strftime("%Y-%m-%d")}}
    if args.plot:
        result["plot"] = plots.bar_chart(
            args.plot, medians, f"training step against TorchRec, {args.np} ranks, batch "
            f"{args.batch_size}/rank", "step time, ms (median of runs)")
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in medians.items():
            print(f"{k:28s} {v:8.1f} ms")
        print(f"speedup vs TorchRec best {result['speedup_vs_torchrec_best']:.2f}x, "
              f"fp32 {result['speedup_vs_torchrec_fp32']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
