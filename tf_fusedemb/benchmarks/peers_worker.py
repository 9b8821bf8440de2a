"""One TorchRec rank of the peer benchmark (``tf_fusedemb.benchmarks.peers``): the lookup
benchmark's DLRM on TorchRec with FBGEMM's CPU kernels, on the batches the driver dumped.

    torchrun --standalone --nproc_per_node 2 tf_fusedemb/benchmarks/peers_worker.py \\
        --batches DIR --sharding table_wise|row_wise [--bf16] --warmup 3 --steps 20

Runs in the peer environment (``make peers-env``: torch, fbgemm-gpu-cpu, torchrec), never
imported by the package, which does not depend on torch. The model, its shape read from
the dump (the lookup benchmark's ``lookup_models.DIM`` and ``HIDDEN``): 26 tables of dim 16
(one per Criteo feature, each sized to the distinct IDs of the dumped batches), sum
pooling, FBGEMM's fused EXACT_ADAGRAD on the rows; concat(26 x 16 + 13) -> 256 relu ->
128 relu -> 1 logit, ``torch.optim.Adagrad`` on the dense weights (DDP averages their
gradients), binary cross-entropy with logits. ``--bf16``: the dense part under
``torch.autocast("cpu", torch.bfloat16)``, the loss in float32. Rank 0 prints one JSON
line: per-step milliseconds (median, p10, p90) of the timed steps.
"""
import argparse
import json
import os
import time
from typing import Callable, List, NamedTuple, Tuple

import numpy as np


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", required=True, help="the driver's dump (rank<R>.npz)")
    parser.add_argument("--sharding", choices=("table_wise", "row_wise"), required=True)
    parser.add_argument("--bf16", action="store_true", help="dense part under bf16 autocast")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.05)
    return parser.parse_args(argv)


class DumpShape(NamedTuple):
    """The model's shape, as the driver dumped it beside the batches."""
    features: List[str]  # one table per feature, in the dump's order
    table_sizes: List[int]  # rows of each feature's table (its distinct IDs)
    dim: int  # embedding dimension of every table
    hidden: Tuple[int, ...]  # widths of the hidden layers of the MLP
    num_dense: int  # dense (numeric) columns of a batch


def dump_shape(data) -> DumpShape:
    """The model's shape read from a rank's dump (``rank<R>.npz``, opened)."""
    return DumpShape(features=[str(f) for f in data["features"]],
                     table_sizes=[int(n) for n in data["table_sizes"]], dim=int(data["dim"]),
                     hidden=tuple(int(h) for h in data["hidden"]),
                     num_dense=data["b0_dense"].shape[1])


def build_model(shape: DumpShape, bf16: bool):
    """The DLRM, unsharded: its tables (``EmbeddingBagConfig``, one per feature) on the
    meta device (DistributedModelParallel materializes only each rank's shards), and its
    MLP, seeded so that every run starts from the same dense weights. Returns (model,
    tables)."""
    # torch and torchrec exist only in the peer environment (module doc): imported in the
    # functions that use them, so that the package's import checks need neither.
    import torch  # pylint: disable=import-outside-toplevel
    from torchrec import (EmbeddingBagCollection, EmbeddingBagConfig,  # pylint: disable=import-outside-toplevel
                          PoolingType)

    class Net(torch.nn.Module):
        """Pooled rows of every table concatenated with the dense columns, then the MLP;
        the MLP under bf16 autocast with ``bf16``, its logit back in float32."""

        def __init__(self, ebc):
            super().__init__()
            self.ebc = ebc
            widths = (len(shape.features) * shape.dim + shape.num_dense,) + shape.hidden
            layers = []
            for a, b in zip(widths, widths[1:]):
                layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
            self.mlp = torch.nn.Sequential(*layers, torch.nn.Linear(shape.hidden[-1], 1))

        def forward(self, kjt, dense):
            h = torch.cat([self.ebc(kjt).values(), dense], 1)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                return self.mlp(h).float()

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t_{c}", embedding_dim=shape.dim, num_embeddings=n,
                                 feature_names=[c], pooling=PoolingType.SUM)
              for c, n in zip(shape.features, shape.table_sizes)]
    return Net(EmbeddingBagCollection(tables=tables, device=torch.device("meta"))), tables


def sharding_plan(model, tables, sharding: str, lr: float, world_size: int):
    """Collective: every table sharded ``sharding`` ("table_wise" or "row_wise") with
    FBGEMM's fused kernel, its rows trained by the kernel's EXACT_ADAGRAD at ``lr``.
    Returns (plan, sharder)."""
    # torch and torchrec exist only in the peer environment (module doc).
    import torch.distributed as dist  # pylint: disable=import-outside-toplevel
    from fbgemm_gpu.split_embedding_configs import EmbOptimType  # pylint: disable=import-outside-toplevel
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel  # pylint: disable=import-outside-toplevel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder  # pylint: disable=import-outside-toplevel
    from torchrec.distributed.planner import (EmbeddingShardingPlanner,  # pylint: disable=import-outside-toplevel
                                              ParameterConstraints, Topology)

    class Sharder(EmbeddingBagCollectionSharder):
        """TorchRec's sharder; on CPU it offers row-wise sharding too (it lists it for GPUs
        only, but its CPU kernels run it)."""

        def sharding_types(self, compute_device_type):
            return list(dict.fromkeys(super().sharding_types(compute_device_type) + ["row_wise"]))

    sharder = Sharder(fused_params={"optimizer": EmbOptimType.EXACT_ADAGRAD,
                                    "learning_rate": lr})
    constraints = {t.name: ParameterConstraints(
        sharding_types=[sharding], compute_kernels=[EmbeddingComputeKernel.FUSED.value])
        for t in tables}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"), constraints=constraints)
    return planner.collective_plan(model, [sharder], dist.GroupMember.WORLD), sharder


def load_batches(data, features: List[str]) -> list:
    """Every batch of the dump as (KeyedJaggedTensor of one ID per sample and feature,
    dense float32[B, 13], label float32[B, 1]), built before timing, as a data loader
    would hand them over."""
    # torch and torchrec exist only in the peer environment (module doc).
    import torch  # pylint: disable=import-outside-toplevel
    from torchrec import KeyedJaggedTensor  # pylint: disable=import-outside-toplevel
    batches = []
    for t in range(int(data["num_batches"])):
        ids = [torch.from_numpy(data[f"b{t}_{c}"]) for c in features]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=features, values=torch.cat(ids),
            lengths=torch.ones(sum(len(i) for i in ids), dtype=torch.int32))
        batches.append((kjt, torch.from_numpy(data[f"b{t}_dense"]),
                        torch.from_numpy(data[f"b{t}_label"])))
    return batches


class TrainStep:
    """One training step of the sharded model on the dump's batches, in turn."""

    def __init__(self, dmp, lr: float, batches: list):
        # torch exists only in the peer environment (module doc).
        import torch  # pylint: disable=import-outside-toplevel
        self.dmp, self.batches = dmp, batches
        # The rows train inside the backward (fused); this optimizer is for the MLP only.
        dense_params = [p for n, p in dmp.named_parameters() if ".ebc." not in f".{n}"]
        self.dense_opt = torch.optim.Adagrad(dense_params, lr=lr)
        self.loss_fn = torch.nn.BCEWithLogitsLoss()

    def __call__(self, t: int) -> float:
        """Step ``t`` (on batch ``t`` modulo their number); returns its loss."""
        kjt, dense, label = self.batches[t % len(self.batches)]
        loss = self.loss_fn(self.dmp(kjt, dense), label)
        self.dense_opt.zero_grad()
        loss.backward()  # the rows' fused Adagrad runs inside the backward
        self.dense_opt.step()
        return float(loss.detach())


def timed_steps(step: Callable[[int], float], warmup: int, steps: int) -> List[float]:
    """Runs ``warmup`` untimed steps, then ``steps`` timed ones, each started together on
    every rank (a barrier first, so a rank's time is not another's lag); returns their
    milliseconds."""
    import torch.distributed as dist  # pylint: disable=import-outside-toplevel  (peer env only)
    for t in range(warmup):
        step(t)
    times = []
    for t in range(warmup, warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        step(t)
        times.append((time.perf_counter() - start) * 1e3)
    return times


class PeerResult(NamedTuple):
    """What rank 0 prints for the driver (its PEER_RESULT line, these fields in order)."""
    sharding: str
    bf16: bool
    ranks: int
    step_ms: float  # median of the timed steps
    p10_ms: float
    p90_ms: float
    steps: int  # timed steps
    torch: str  # torch's version
    threads: int  # torch's intra-op threads per rank


def peer_result(args: argparse.Namespace, times: List[float], world_size: int) -> PeerResult:
    """The run's result from the timed steps' milliseconds."""
    import torch  # pylint: disable=import-outside-toplevel  (peer environment only)
    ms = np.array(times)
    return PeerResult(sharding=args.sharding, bf16=args.bf16, ranks=world_size,
                      step_ms=float(np.median(ms)), p10_ms=float(np.percentile(ms, 10)),
                      p90_ms=float(np.percentile(ms, 90)), steps=len(ms),
                      torch=torch.__version__, threads=torch.get_num_threads())


def main(argv=None):
    """One rank: the model built and sharded, the batches loaded, the steps timed; rank 0
    prints the result."""
    # torch and torchrec exist only in the peer environment (module doc).
    import torch  # pylint: disable=import-outside-toplevel
    import torch.distributed as dist  # pylint: disable=import-outside-toplevel
    from torchrec.distributed import DistributedModelParallel  # pylint: disable=import-outside-toplevel

    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    data = np.load(os.path.join(args.batches, f"rank{rank}.npz"))
    shape = dump_shape(data)
    model, tables = build_model(shape, args.bf16)
    plan, sharder = sharding_plan(model, tables, args.sharding, args.lr, size)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan,
                                   sharders=[sharder])
    step = TrainStep(dmp, args.lr, load_batches(data, shape.features))
    times = timed_steps(step, args.warmup, args.steps)
    if rank == 0:
        print("PEER_RESULT " + json.dumps(peer_result(args, times, size)._asdict()), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
