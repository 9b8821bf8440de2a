"""Worker of tests/test_incremental_checkpoint.py on several ranks: restores a chain
written by another number of ranks into a fresh model, and into a fresh tiered one (a
memory budget, its SSD tier under --spill-dir), and a full checkpoint of the same step
into a third, and asserts their states equal on every rank; then changes the model
further and saves its own chain (a full checkpoint and two deltas) and a full reference
into --out.

    horovodrun -np 2 --gloo -H localhost:2 python tests/incremental_checkpoint_worker.py \\
        --restore CHAIN/ckpt-3 --reference FULL/ckpt-3 --out DIR --spill-dir SPILL
"""
import argparse
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import incremental_checkpoint_model as icm  # noqa: E402
from tf_fusedemb.training import CheckpointManager  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--restore", required=True)
    parser.add_argument("--reference", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--spill-dir", required=True)
    args = parser.parse_args(argv)

    states = []
    for path, build in ((args.restore, dict(budget=1500, spill_dir=args.spill_dir)),
                        (args.restore, {}), (args.reference, {})):
        model, layer = icm.build(**build)
        CheckpointManager(os.path.dirname(path), model, model.optimizer).restore(path)
        states.append(icm.state(model, layer))
    icm.assert_same(states[0], states[2], "chain restored tiered vs full checkpoint")
    icm.assert_same(states[1], states[2], "chain vs full checkpoint on this rank")
    assert len(states[0][f"{icm.engine_group(layer).group.name}/keys"]) > 0

    # Go on from the restored state: its own chain on this world size.
    chain = CheckpointManager(os.path.join(args.out, "chain"), model, model.optimizer,
                              incremental=True)
    for phase in range(3, 6):
        icm.change(model, layer, phase)
        chain.save(phase - 2)
    CheckpointManager(os.path.join(args.out, "full"), model, model.optimizer).save(3)
    print("WORKER DONE", flush=True)


if __name__ == "__main__":
    main()
