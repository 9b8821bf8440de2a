"""Worker: the communicator's topology and its set-restricted AlltoAlls (node, rail) with
their gradients, checked against values every rank can compute by hand. Prints
"RESULT <json>" on every rank.

    TF_FUSEDEMB_TOPOLOGY=2x2 horovodrun -np 4 --gloo -H localhost:4 python tests/topology_probe.py
"""
import json
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf_fusedemb.comm import CommCounters, get_communicator  # noqa: E402


def payload(sender, members, receiver_index):
    """Rows ``sender`` sends to the member at ``receiver_index``: 1 + index rows, each
    [sender, receiver rank]."""
    return [[float(sender), float(members[receiver_index])]] * (1 + receiver_index)


def check_set(comm, members, name, counters):
    """AlltoAll among ``members`` (and its gradient); returns a list of failures."""
    rank = comm.rank
    rows = [r for i in range(len(members)) for r in payload(rank, members, i)]
    splits = [1 + i for i in range(len(members))]
    x = tf.constant(rows, tf.float32)

    @tf.function
    def run(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            got, recv = comm.alltoall(x, tf.constant(splits), name, counters, members)
            loss = tf.reduce_sum(got * tf.cast(tf.range(tf.shape(got)[0]) + 1, tf.float32)[:, None])
        return got, recv, tape.gradient(loss, x)
    got, recv, grad = (t.numpy() for t in run(x))
    me = members.index(rank)
    want = np.array([r for s in members for r in payload(s, members, me)], np.float32)
    failures = []
    if not np.array_equal(got, want):
        failures.append(f"{name}: received {got.tolist()} != {want.tolist()}")
    if recv.tolist() != [1 + me] * len(members):
        failures.append(f"{name}: received splits {recv.tolist()}")
    # d loss / d x: the receiver's row position + 1, sent back to each sender.
    want_grad = []
    for i in range(len(members)):
        offset = me * (1 + i)  # rows member i received from the senders before me
        want_grad += [[offset + k + 1] * 2 for k in range(1 + i)]
    if not np.array_equal(grad, np.array(want_grad, np.float32)):
        failures.append(f"{name}: gradient {grad.tolist()} != {want_grad}")
    return failures


def main():
    comm = get_communicator()
    topo = comm.topology
    counters = CommCounters("probe", link_classes=True)
    failures = []
    failures += check_set(comm, topo.node_members(), "probe/node", counters)
    failures += check_set(comm, topo.rail_members(), "probe/rail", counters)
    failures += check_set(comm, list(range(comm.size)), "probe/world", counters)
    print("RESULT " + json.dumps({
        "rank": comm.rank, "size": comm.size, "local_size": topo.local_size,
        "cross_size": topo.cross_size, "local_rank": topo.local_rank,
        "cross_rank": topo.cross_rank, "node": topo.node_members(), "rail": topo.rail_members(),
        "process_sets": comm.process_sets,
        "counters": counters.snapshot(), "failures": failures}), flush=True)


if __name__ == "__main__":
    main()
