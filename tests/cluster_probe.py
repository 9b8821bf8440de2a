"""A tiny Horovod-TF job for tests/test_cluster.py, run on every rank of an emulated cluster.

    python tests/cluster_probe.py MB_PER_PEER

Prints one JSON line per rank: its topology as Horovod sees it, an allreduce result, the
seconds one alltoall of MB_PER_PEER megabytes to every peer took (after a warm-up, so
connection setup is not timed), and the host it runs in (its cores, Gloo's interface
address, the network devices /sys shows, its /etc/hosts). Exits 1 if the alltoall returned
wrong values.
"""
import json
import os
import sys
import time

PRELOADED = "tensorflow" in sys.modules  # forked from a fork server, not started bare

import numpy as np
import psutil
import tensorflow as tf
import horovod.tensorflow as hvd


def host() -> dict:
    """What tells the emulated host a rank runs in from another: its address on Gloo's
    interface, the devices of its network namespace in /sys, its /etc/hosts."""
    iface = os.environ.get("HOROVOD_GLOO_IFACE", "")
    with open("/etc/hosts") as f:
        hosts = f.read()
    return {"address": [a.address for a in psutil.net_if_addrs().get(iface, [])
                        if a.family == 2],  # AF_INET
            "sys_class_net": sorted(os.listdir("/sys/class/net")), "etc_hosts": hosts}


def main() -> int:
    mb_per_peer = float(sys.argv[1])
    hvd.init()
    size, rank = hvd.size(), hvd.rank()
    total = hvd.allreduce(tf.constant([float(rank + 1)]), op=hvd.Sum).numpy()[0]
    n = int(mb_per_peer * 1e6 / 4)  # float32 values per peer
    # Row j (sent to rank j) holds 1000 * rank + j, so the receiver can tell who sent what.
    send = tf.constant(np.repeat(1000.0 * rank + np.arange(size, dtype=np.float32), n))
    hvd.alltoall(send[: size * 256], name="warmup")  # connections up before timing
    hvd.allreduce(tf.constant(0.0), name="barrier")
    start = time.perf_counter()
    received = hvd.alltoall(send, name="timed").numpy()
    seconds = time.perf_counter() - start
    expected = np.repeat(1000.0 * np.arange(size, dtype=np.float32) + rank, n)
    ok = bool(np.array_equal(received, expected))
    print(json.dumps({"rank": rank, "size": size, "local_size": hvd.local_size(),
                      "cross_size": hvd.cross_size(), "local_rank": hvd.local_rank(),
                      "cross_rank": hvd.cross_rank(), "allreduce": float(total),
                      "alltoall_ok": ok, "alltoall_s": seconds, "mb_per_peer": mb_per_peer,
                      "cpus": sorted(os.sched_getaffinity(0)),
                      "intra_op_threads": os.environ.get("TF_NUM_INTRAOP_THREADS"),
                      "host": host(), "preloaded": PRELOADED}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
