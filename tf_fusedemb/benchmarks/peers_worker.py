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


def main(argv=None):
    # torch and torchrec exist only in the peer environment: imported here, so that the
    # package's import checks (which import every module) need neither.
    import torch  # pylint: disable=import-outside-toplevel
    import torch.distributed as dist  # pylint: disable=import-outside-toplevel
    from fbgemm_gpu.split_embedding_configs import EmbOptimType  # pylint: disable=import-outside-toplevel
    from torchrec import (EmbeddingBagCollection, EmbeddingBagConfig,  # pylint: disable=import-outside-toplevel
                          KeyedJaggedTensor, PoolingType)
    from torchrec.distributed import DistributedModelParallel  # pylint: disable=import-outside-toplevel
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel  # pylint: disable=import-outside-toplevel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder  # pylint: disable=import-outside-toplevel
    from torchrec.distributed.planner import (EmbeddingShardingPlanner,  # pylint: disable=import-outside-toplevel
                                              ParameterConstraints, Topology)

    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    data = np.load(os.path.join(args.batches, f"rank{rank}.npz"))
    sizes, features = data["table_sizes"], [str(f) for f in data["features"]]
    dim, hidden = int(data["dim"]), tuple(int(h) for h in data["hidden"])
    num_dense = data["b0_dense"].shape[1]

    class Net(torch.nn.Module):
        def __init__(self, ebc):
            super().__init__()
            self.ebc = ebc
            widths = (len(features) * dim + num_dense,) + hidden
            layers = []
            for a, b in zip(widths, widths[1:]):
                layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
            self.mlp = torch.nn.Sequential(*layers, torch.nn.Linear(hidden[-1], 1))

        def forward(self, kjt, dense):
            h = torch.cat([self.ebc(kjt).values(), dense], 1)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                return self.mlp(h).float()

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t_{c}", embedding_dim=dim, num_embeddings=int(n),
                                 feature_names=[c], pooling=PoolingType.SUM)
              for c, n in zip(features, sizes)]
    model = Net(EmbeddingBagCollection(tables=tables, device=torch.device("meta")))

    class Sharder(EmbeddingBagCollectionSharder):
        """TorchRec's sharder; on CPU it offers row-wise sharding too (it lists it for GPUs
        only, but its CPU kernels run it)."""

        def sharding_types(self, compute_device_type):
            return list(dict.fromkeys(super().sharding_types(compute_device_type) + ["row_wise"]))

    sharder = Sharder(fused_params={"optimizer": EmbOptimType.EXACT_ADAGRAD,
                                    "learning_rate": args.lr})
    constraints = {t.name: ParameterConstraints(
        sharding_types=[args.sharding], compute_kernels=[EmbeddingComputeKernel.FUSED.value])
        for t in tables}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=size, compute_device="cpu"), constraints=constraints)
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan,
                                   sharders=[sharder])
    dense_params = [p for n, p in dmp.named_parameters() if ".ebc." not in f".{n}"]
    dense_opt = torch.optim.Adagrad(dense_params, lr=args.lr)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    batches = []  # built before timing, as a data loader would hand them over
    for t in range(int(data["num_batches"])):
        ids = [torch.from_numpy(data[f"b{t}_{c}"]) for c in features]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=features, values=torch.cat(ids),
            lengths=torch.ones(sum(len(i) for i in ids), dtype=torch.int32))
        batches.append((kjt, torch.from_numpy(data[f"b{t}_dense"]),
                        torch.from_numpy(data[f"b{t}_label"])))

    def step(t):
        kjt, dense, label = batches[t % len(batches)]
        loss = loss_fn(dmp(kjt, dense), label)
        dense_opt.zero_grad()
        loss.backward()  # the rows' fused Adagrad runs inside the backward
        dense_opt.step()
        return float(loss.detach())

    for t in range(args.warmup):
        step(t)
    times = []
    for t in range(args.warmup, args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        step(t)
        times.append((time.perf_counter() - start) * 1e3)
    if rank == 0:
        ms = np.array(times)
        print("PEER_RESULT " + json.dumps({
            "sharding": args.sharding, "bf16": args.bf16, "ranks": size,
            "step_ms": float(np.median(ms)), "p10_ms": float(np.percentile(ms, 10)),
            "p90_ms": float(np.percentile(ms, 90)), "steps": len(ms),
            "torch": torch.__version__, "threads": torch.get_num_threads()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
