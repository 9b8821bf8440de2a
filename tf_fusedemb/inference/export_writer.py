"""Writing an export's SavedModel directory from every rank, the table never gathered.

Every rank writes its own segment of each group's ``KeyIndex`` variables (its stored
rows, read from its table a chunk at a time, tiered tables included) as slices of the
global variables, with ``SaveV2``'s ``shape_and_slices``, into checkpoint bundles of its
own; rank 0 writes the graph (``tf.saved_model.save`` of a module whose index variables
are empty) and its dense variables; then rank 0 merges every bundle into the
SavedModel's ``variables/`` with ``MergeV2Checkpoints``. A variable written in slices
reads back whole, so the result is one ordinary SavedModel.

Atomicity: everything is written under ``<export_dir>.tmp`` and renamed into place by
rank 0 at the end; a rank that fails or dies before leaves at most that temporary
directory (removed by the next export), never a half-written export. The ranks must
share the export directory's filesystem (one host, or a shared filesystem); ranks that
do not see rank 0's temporary directory make every rank fail in one line first.
"""
import os
import shutil
from typing import Callable, List, NamedTuple, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_fusedemb.comm import Communicator
from tf_fusedemb.inference.key_index import pad_segment, read_rows
from tf_fusedemb.layers.group_store import GroupStore

# Rows read from a table and written per SaveV2 call: bounds what a rank holds beyond its
# table (2^16 rows of dim 16 are 4 MiB in float32).
CHUNK_ROWS = 1 << 16
PARTS = "parts"
MODEL = "model"
MARKER = "written-by-rank-0"


class IndexNames(NamedTuple):
    """The checkpoint keys of one group's KeyIndex variables in the SavedModel: the group
    is ``serving_groups_[position]`` of the exported module."""
    keys: str
    lengths: str
    rows: str
    scales: str

    @classmethod
    def of(cls, position: int) -> "IndexNames":
        def key(field):
            return f"serving_groups_/{position}/index/{field}/.ATTRIBUTES/VARIABLE_VALUE"
        return cls(key("keys"), key("lengths"), key("rows"), key("scales"))


def _save(prefix: str, names: Sequence[str], slices: Sequence[str],
          tensors: Sequence[np.ndarray]) -> None:
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=list(names), shape_and_slices=list(slices),
                      tensors=[tf.constant(t) for t in tensors])


def write_segment(store: GroupStore, names: IndexNames, prefix: str, rank: int, size: int,
                  width: int, row_dtype: str, chunk_rows: Optional[int] = None) -> None:
    """Writes rank ``rank`` of ``size``'s segment (its stored rows, padded to ``width``) of
    the group's index variables as slices [rank, start:stop] of int64[size, width] keys,
    [size, width, dim] rows and float32[size, width] scales (int8) plus int64[size]
    lengths, in bundles ``<prefix>-*``, reading ``chunk_rows`` rows at a time."""
    chunk_rows = chunk_rows or CHUNK_ROWS
    ordered = store.stored_init_keys(chunk_rows)
    dim, no_keys = store.group.dim, np.zeros([0], np.int64)
    _save(f"{prefix}-lengths", [names.lengths], [f"{size} {rank},1"],
          [np.array([ordered.num_keys], np.int64)])
    # Every chunk but the last real one holds chunk_rows keys; past them, padding.
    for start in range(0, width, chunk_rows):
        stop = min(start + chunk_rows, width)
        keys, init_keys = next(ordered.chunks, (no_keys, no_keys))
        segment = pad_segment(init_keys, read_rows(store, keys, init_keys), row_dtype,
                              stop - start)
        where = f"{rank},1:{start},{stop - start}"
        tensors = [(names.keys, f"{size} {width} {where}", segment.keys[None]),
                   (names.rows, f"{size} {width} {dim} {where}:-", segment.rows[None])]
        if segment.scales is not None:
            tensors.append((names.scales, f"{size} {width} {where}", segment.scales[None]))
        _save(f"{prefix}-{start}", *zip(*tensors))


def _without(source: str, destination: str, dropped: Sequence[str]) -> None:
    """Rewrites the bundle ``source`` as ``destination`` without the tensors ``dropped``
    (which it must hold: the index variables' names follow the exported module)."""
    reader = tf.train.load_checkpoint(source)
    dtypes = reader.get_variable_to_dtype_map()
    missing = sorted(set(dropped) - set(dtypes))
    if missing:
        raise RuntimeError(f"the exported module has no variables {missing}: the serving "
                           "groups' index variables are not where the writer expects them")
    kept = sorted(set(dtypes) - set(dropped))
    tf.raw_ops.SaveV2(prefix=destination, tensor_names=kept, shape_and_slices=[""] * len(kept),
                      tensors=[tf.constant(reader.get_tensor(n), dtypes[n]) for n in kept])


class ExportWriter:
    """Writes one export directory from every rank (see the module docstring).

    Args:
      export_dir: the SavedModel directory to create (replaced if it exists).
      comm: the model's communicator (every rank calls ``write`` together).
    """

    def __init__(self, export_dir: str, comm: Communicator):
        self.export_dir = export_dir.rstrip("/")
        self.comm = comm
        self.tmp = self.export_dir + ".tmp"

    def _barrier(self, name: str) -> None:
        with self.comm.watch(f"barrier fusedemb/{name}"):
            self.comm.allreduce_sum(tf.constant(0, tf.int32), f"fusedemb/{name}").numpy()

    def _make_shared_tmp(self) -> None:
        """Rank 0 makes the temporary directory; every rank checks that it sees it, and
        all fail in one line together when some do not."""
        if self.comm.rank == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)  # an interrupted export's debris
            os.makedirs(os.path.join(self.tmp, PARTS))
            open(os.path.join(self.tmp, MARKER), "w").close()
        self._barrier("export_mkdir")
        blind = int(self.comm.allreduce_sum(tf.constant(
            int(not os.path.exists(os.path.join(self.tmp, MARKER))), tf.int32),
            "fusedemb/export_shared").numpy())
        if blind:
            raise ValueError(f"export directory {self.export_dir}: {blind} of {self.comm.size} "
                             f"ranks do not see rank 0's {self.tmp}; export to a filesystem "
                             "every rank shares")

    def write(self, groups: Sequence[GroupStore], row_dtype: str,
              save_graph: Callable[[str], None]) -> str:
        """Writes the export: every rank its segments of ``groups`` (in the exported
        module's order), rank 0 the graph through ``save_graph(directory)`` (a
        ``tf.saved_model.save`` whose index variables are empty). Returns ``export_dir``."""
        with self.comm.watch(f"SavedModel export to {self.export_dir}"):
            self._make_shared_tmp()
            widths = self._widths(groups)
            parts = os.path.join(self.tmp, PARTS)
            rank, size = self.comm.rank, self.comm.size
            for g, (store, width) in enumerate(zip(groups, widths)):
                write_segment(store, IndexNames.of(g), os.path.join(parts, f"g{g}-r{rank}"),
                              rank, size, width, row_dtype)
            model = os.path.join(self.tmp, MODEL)
            names = [IndexNames.of(g) for g in range(len(groups))]
            if rank == 0:
                save_graph(model)
                self._dense_part(model, names, row_dtype)
            self._barrier("export_parts")  # every rank's parts are complete
            if rank == 0:
                self._merge(model)
                shutil.rmtree(self.export_dir, ignore_errors=True)
                os.rename(model, self.export_dir)
                shutil.rmtree(self.tmp, ignore_errors=True)
            self._barrier("export_done")
        return self.export_dir

    def _widths(self, groups: Sequence[GroupStore]) -> List[int]:
        """Each group's segment width L: its largest share of stored rows over the ranks
        (at least 1)."""
        counts = np.array([g.num_stored_rows() for g in groups], np.int64)
        every = np.stack(self.comm.allgather_object(counts)) if len(groups) else counts
        return [max(1, int(w)) for w in np.max(every, axis=0, initial=0).reshape(-1)]

    def _dense_part(self, model: str, names: Sequence[IndexNames], row_dtype: str) -> None:
        """Rank 0: the variables ``save_graph`` wrote, less the (empty) index variables,
        become a part of their own; the SavedModel's ``variables/`` is emptied."""
        variables = os.path.join(model, "variables", "variables")
        dropped = [n for group in names for n in group
                   if row_dtype == "int8" or n != group.scales]
        _without(variables, os.path.join(self.tmp, PARTS, "dense"), dropped)
        for name in os.listdir(os.path.dirname(variables)):
            os.remove(os.path.join(os.path.dirname(variables), name))

    def _merge(self, model: str) -> None:
        """Rank 0, once every rank wrote its parts: they become the SavedModel's
        variables (``MergeV2Checkpoints``)."""
        parts = os.path.join(self.tmp, PARTS)
        prefixes = sorted(os.path.join(parts, f[:-len(".index")])
                          for f in os.listdir(parts) if f.endswith(".index"))
        tf.raw_ops.MergeV2Checkpoints(
            checkpoint_prefixes=prefixes, delete_old_dirs=False,
            destination_prefix=os.path.join(model, "variables", "variables"))
