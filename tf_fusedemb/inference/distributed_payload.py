"""The message one rank pushes to a sample's owner in sharded inference.

Per feature of the model (in a fixed order every rank knows) one block of m entries:
``index`` int64[m] (pooled: the owner's local sample; sequence: the ID's position in the
owner's flat IDs), ``count`` int64[m] (how many of the sample's IDs the sender summed;
1 for a sequence row) and ``values`` float64[m, dim] (partial sums, or the row itself;
float64 so that adding partials from several ranks loses nothing before the owner
rounds once). Layout: int64 header [F] of the m's, then each block's three arrays.
"""
from typing import List, Sequence, Tuple

import numpy as np

Block = Tuple[np.ndarray, np.ndarray, np.ndarray]  # (index int64[m], count int64[m], values f64[m, d])



def pack(blocks: Sequence[Block]) -> np.ndarray:
    """uint8 bytes of the blocks (see module doc)."""
    header = np.array([len(b[0]) for b in blocks], np.int64)
    parts: List[np.ndarray] = [header]
    for index, count, values in blocks:
        parts += [np.asarray(index, np.int64), np.asarray(count, np.int64),
                  np.asarray(values, np.float64).reshape(-1)]
    return np.concatenate([p.view(np.uint8) for p in parts])


def unpack(buffer: np.ndarray, dims: Sequence[int]) -> List[Block]:
    """Blocks of ``buffer`` (uint8), one per feature of width ``dims[f]``."""
    data = np.asarray(buffer, np.uint8)
    if data.nbytes == 0 and not dims:
        return []
    if data.nbytes < 8 * len(dims):
        raise ValueError(f"sharded inference: a message of {data.nbytes} bytes cannot hold "
                         f"the header of {len(dims)} features")
    header = data[:8 * len(dims)].view(np.int64)
    offset, blocks = 8 * len(dims), []
    for m, dim in zip(header, dims):
        m = int(m)
        index = data[offset:offset + 8 * m].view(np.int64)
        count = data[offset + 8 * m:offset + 16 * m].view(np.int64)
        offset += 16 * m
        values = data[offset:offset + 8 * m * dim].view(np.float64).reshape(m, dim)
        offset += 8 * m * dim
        blocks.append((index, count, values))
    if offset != data.nbytes:
        raise ValueError(f"sharded inference: message of {data.nbytes} bytes, its header "
                         f"describes {offset}: the ranks run different models")
    return blocks


def capacity_bytes(max_entries: Sequence[int], dims: Sequence[int]) -> int:
    """Largest message for at most ``max_entries[f]`` entries of feature f."""
    return 8 * len(dims) + sum(m * (16 + 8 * d) for m, d in zip(max_entries, dims))
