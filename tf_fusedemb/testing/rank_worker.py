"""One rank of ``DistributedTestCase.run_ranks``: loads ``(fn, args)``, runs ``fn(*args)`` and
writes the result where the test reads it.

    python -m tf_fusedemb.testing.rank_worker JOB.pkl OUT_DIR     (one rank of a Gloo job)
"""
import os
import sys

from tf_fusedemb import quiet


def main(job: str, out_dir: str) -> None:
    quiet.install()  # a rank of the project's launcher: quiet TensorFlow before it loads
    import cloudpickle  # optional: comes with Horovod  pylint: disable=import-outside-toplevel
    with open(job, "rb") as f:
        fn, args = cloudpickle.load(f)
    result = fn(*args)
    # The launcher names the rank in the environment; fn need not have started Horovod.
    path = os.path.join(out_dir, f"rank{int(os.environ.get('HOROVOD_RANK', '0'))}.pkl")
    with open(path + ".tmp", "wb") as f:
        cloudpickle.dump(result, f)
    os.replace(path + ".tmp", path)  # a result file is whole or absent


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m tf_fusedemb.testing.rank_worker JOB.pkl OUT_DIR")
    main(sys.argv[1], sys.argv[2])
