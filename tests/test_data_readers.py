"""Real-data readers (criteo, movielens, avazu) against independent Python parses of the same files.

Tests on the shared samples skip with a message when ../shared/data is absent; the tmp_path tests
(Criteo edge cases, MovieLens ties, pipeline helpers) always run.
"""
import csv
import math
import os
from pathlib import Path

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf_fusedemb.data import pipeline  # noqa: E402
from tf_fusedemb.data.avazu import AVAZU_CATEGORICAL, avazu_dataset  # noqa: E402
from tf_fusedemb.data.criteo import (CRITEO_CATEGORICAL, CRITEO_DENSE, criteo_dataset,  # noqa: E402
                                     criteo_eval_split, parse_hex32)
from tf_fusedemb.data.movielens import GENRES, movielens_dataset, movielens_info  # noqa: E402

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _data(sub):
    path = DATA / sub
    if not path.is_dir():
        pytest.skip(f"real data sample {sub} not found at {path} (see shared/data/README.md)")
    return path


@pytest.fixture
def criteo_train():
    return str(_data("criteo-kaggle-sample") / "train.txt")


@pytest.fixture
def ml_dir():
    return str(_data("movielens-latest-small"))


@pytest.fixture
def avazu_dir():
    return _data("avazu-sample")


def collect(ds):
    """All batches concatenated: {name: np.ndarray or list of lists (ragged)}, label [n]."""
    out, labels = {}, []
    for feats, label in ds:
        assert label.dtype == tf.float32 and label.shape.rank == 2 and label.shape[1] == 1
        labels.append(label.numpy()[:, 0])
        for k, v in feats.items():
            ragged = isinstance(v, tf.RaggedTensor)
            out.setdefault(k, []).append(v.to_list() if ragged else v.numpy())
    res = {k: (sum(v, []) if isinstance(v[0], list) else np.concatenate(v)) for k, v in out.items()}
    return res, np.concatenate(labels)


# ----------------------------------------------------------------------------------------- Criteo
def criteo_python(path):
    """Independent parse: (labels [n], dense float32 [n, 13], ids int64 [n, 26])."""
    labels, dense, ids = [], [], []
    with open(path) as f:
        for line in f:
            p = line.rstrip("\n").split("\t")
            labels.append(float(p[0]))
            dense.append([math.log1p(max(int(x), 0)) if x else 0.0 for x in p[1:14]])
            ids.append([int(h, 16) if h else 0 for h in p[14:]])
    return np.array(labels), np.array(dense, np.float32), np.array(ids, np.int64)


def test_criteo_matches_python_parse(criteo_train):
    labels, dense, ids = criteo_python(criteo_train)
    feats, got_labels = collect(criteo_dataset(criteo_train, 1000 - 7))   # partial last batch
    assert got_labels.shape == (8000,)
    np.testing.assert_array_equal(got_labels, labels)
    for k, name in enumerate(CRITEO_DENSE):
        assert feats[name].dtype == np.float32
        np.testing.assert_allclose(feats[name], dense[:, k], rtol=1e-6, err_msg=name)
    for k, name in enumerate(CRITEO_CATEGORICAL):
        assert feats[name].dtype == np.int64
        np.testing.assert_array_equal(feats[name], ids[:, k], err_msg=name)
    assert feats["C1"][0] == int("68fd1e64", 16) and feats["C22"][0] == 0   # row 1: C22 empty


def test_criteo_edge_cases(tmp_path):
    cats = ["ffffffff", "", "0", "1", "FFFFFFFF", "00000001", "80000000", "abc"] + [""] * 18
    rows = [["1", "", "-3", "0", "12345678"] + ["7"] * 9 + cats,
            ["0"] + [""] * 13 + ["7fffffff"] * 26]
    path = tmp_path / "edge.tsv"
    path.write_text("".join("\t".join(r) + "\n" for r in rows))
    feats, labels = collect(criteo_dataset(str(path), 4, drop_remainder=False))
    np.testing.assert_array_equal(labels, [1.0, 0.0])
    np.testing.assert_allclose(feats["I1"], [0.0, 0.0])           # empty -> 0
    np.testing.assert_allclose(feats["I2"], [0.0, 0.0])           # negative -> log1p(0)
    np.testing.assert_allclose(feats["I4"], [np.log1p(12345678), 0.0], rtol=1e-6)
    got = [int(feats[f"C{k}"][0]) for k in range(1, 9)]
    assert got == [0xFFFFFFFF, 0, 0, 1, 0xFFFFFFFF, 1, 0x80000000, 0xABC]
    assert all(int(feats[c][1]) == 0x7FFFFFFF for c in CRITEO_CATEGORICAL)
    values = parse_hex32(tf.constant(["", "f", "10", "Deadbeef", "0123456", "9"]))
    assert values.numpy().tolist() == [0, 15, 16, 0xDEADBEEF, 0x123456, 9]


@pytest.mark.parametrize("bad, what", [("\t".join(["0"] * 39), "39 fields"),
                                       ("\t".join(["0"] * 41), "41 fields"),
                                       ("\t".join(["0"] * 14 + ["xyz1"] + ["1"] * 25), "hex"),
                                       ("\t".join(["0"] * 14 + ["123456789"] + ["1"] * 25), "hex")])
def test_criteo_bad_line_names_file(tmp_path, bad, what):
    good = "\t".join(["1"] * 14 + ["abc"] * 26)
    first, second = tmp_path / "a.tsv", tmp_path / "b.tsv"
    first.write_text(good + "\n")
    second.write_text(good + "\n" + good + "\n" + bad + "\n" + good + "\n")
    with pytest.raises(tf.errors.InvalidArgumentError) as err:
        collect(criteo_dataset([str(first), str(second)], 2))
    msg = str(err.value)
    assert "b.tsv line 3" in msg and what in msg, msg


def test_criteo_sharding_disjoint_and_complete(criteo_train):
    full, full_labels = collect(criteo_dataset(criteo_train, 512))
    parts = [collect(criteo_dataset(criteo_train, 300, num_shards=3, shard_index=r))
             for r in range(3)]
    for r, (feats, labels) in enumerate(parts):   # rank r holds lines r, r+3, ... in order
        np.testing.assert_array_equal(labels, full_labels[r::3])
        np.testing.assert_array_equal(feats["C3"], full["C3"][r::3])
    assert sum(len(p[1]) for p in parts) == len(full_labels)
    with pytest.raises(ValueError):
        criteo_dataset(criteo_train, 8, num_shards=2, shard_index=2)


def test_criteo_shuffle_deterministic_and_split(criteo_train):
    a = collect(criteo_dataset(criteo_train, 256, shuffle_buffer=1000, seed=3))[0]["C3"]
    b = collect(criteo_dataset(criteo_train, 256, shuffle_buffer=1000, seed=3))[0]["C3"]
    c = collect(criteo_dataset(criteo_train, 256, shuffle_buffer=1000, seed=4))[0]["C3"]
    plain = collect(criteo_dataset(criteo_train, 256))[0]["C3"]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c) and not np.array_equal(a, plain)
    np.testing.assert_array_equal(np.sort(a), np.sort(plain))
    train, ev = criteo_eval_split(criteo_train, 512, eval_fraction=0.1, shuffle_buffer=100)
    tr, ev = collect(train)[0]["C3"], collect(ev)[0]["C3"]
    assert len(tr) == 7200 and len(ev) == 800
    np.testing.assert_array_equal(ev, plain[-800:])      # the chronological tail, in order
    np.testing.assert_array_equal(np.sort(tr), np.sort(plain[:7200]))


def test_criteo_under_tf_function(criteo_train):
    labels, _, ids = criteo_python(criteo_train)
    ds = criteo_dataset(criteo_train, 1024, drop_remainder=True)
    assert ds.element_spec[1].shape.as_list() == [1024, 1]
    assert ds.element_spec[0]["C1"].shape.as_list() == [1024]

    @tf.function
    def total(dataset):
        n, pos, s = tf.constant(0, tf.int64), tf.constant(0.0), tf.constant(0, tf.int64)
        for feats, label in dataset:
            n += tf.shape(label, out_type=tf.int64)[0]
            pos += tf.reduce_sum(label)
            s += tf.reduce_sum(feats["C9"])
        return n, pos, s

    n, pos, s = total(ds)
    assert int(n) == 7168 and float(pos) == labels[:7168].sum()
    assert int(s) == ids[:7168, 8].sum()


# -------------------------------------------------------------------------------------- MovieLens
def movielens_python(directory, history_len, test_fraction):
    """Independent parse: per ratings.csv row (user, movie, genres, history, label, is_test)."""
    genres = sorted({g for r in csv.DictReader(open(os.path.join(directory, "movies.csv")))
                     for g in r["genres"].split("|")})
    movie_genres = {int(r["movieId"]): [genres.index(g) for g in r["genres"].split("|")]
                    for r in csv.DictReader(open(os.path.join(directory, "movies.csv")))}
    rows = [(int(r["userId"]), int(r["movieId"]), float(r["rating"]), int(r["timestamp"]))
            for r in csv.DictReader(open(os.path.join(directory, "ratings.csv")))]
    per_user = {}
    for i, (u, m, _, t) in enumerate(rows):
        per_user.setdefault(u, []).append((t, i, m))
    out = [None] * len(rows)
    for u, events in per_user.items():
        events.sort()
        n_test = int(len(events) * test_fraction + 1e-9)
        for k, (t, i, m) in enumerate(events):
            hist = [e[2] for e in events[:k]][-history_len:] if history_len else []
            out[i] = (u, m, movie_genres.get(m, []), hist, float(rows[i][2] >= 4.0),
                      k >= len(events) - n_test)
    return genres, out


def test_movielens_matches_python_parse(ml_dir):
    genres, ref = movielens_python(ml_dir, 20, 0.1)
    assert tuple(genres) == GENRES
    feats, labels = collect(movielens_dataset(ml_dir, 1000, split="all").take(3))
    for i in range(3000):
        u, m, g, h, lab, _ = ref[i]
        assert (feats["user"][i], feats["movie"][i], labels[i]) == (u, m, lab), i
        assert feats["genres"][i] == g and feats["history"][i] == h, i
    feats, labels = collect(movielens_dataset(ml_dir, 4096, split="test"))
    want = [r for r in ref if r[5]]
    assert len(labels) == len(want)
    got = [(int(u), int(m)) for u, m in zip(feats["user"], feats["movie"])]
    assert got == [r[:2] for r in want]
    assert feats["history"] == [r[3] for r in want] and list(labels) == [r[4] for r in want]
    info = movielens_info(ml_dir)
    assert info["num_ratings"] == len(ref) and info["genre_vocab_size"] == len(GENRES)
    assert info["user_vocab_size"] > max(r[0] for r in ref)
    assert info["movie_vocab_size"] > max(r[1] for r in ref)


def test_movielens_ties_unknown_movies_and_split(tmp_path):
    (tmp_path / "movies.csv").write_text(
        'movieId,title,genres\n1,"A, the (1990)",Drama|Comedy\n2,B,(no genres listed)\n3,C,IMAX\n')
    (tmp_path / "ratings.csv").write_text(
        "userId,movieId,rating,timestamp\n"
        "7,3,5.0,100\n7,1,4.0,50\n7,2,3.5,100\n7,9,1.0,200\n8,1,4.0,10\n")
    feats, labels = collect(movielens_dataset(str(tmp_path), 8, history_len=2, split="all",
                                              test_fraction=0.5))
    assert labels.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert feats["genres"] == [[GENRES.index("IMAX")], [8, 5], [0], [], [8, 5]]
    # user 7 in time order: 1 (t50), 3 (t100, line 2), 2 (t100, line 4), 9 (t200)
    assert feats["history"] == [[1], [], [1, 3], [3, 2], []]
    test, _ = collect(movielens_dataset(str(tmp_path), 8, split="test", test_fraction=0.5))
    assert test["movie"].tolist() == [2, 9]      # floor(4 * 0.5) = 2 of user 7, floor(0.5) = 0


def test_movielens_sharding_determinism_ragged(ml_dir):
    full, full_labels = collect(movielens_dataset(ml_dir, 2048, seed=5))
    again, _ = collect(movielens_dataset(ml_dir, 2048, seed=5))
    other, _ = collect(movielens_dataset(ml_dir, 2048, seed=6))
    np.testing.assert_array_equal(full["movie"], again["movie"])
    assert not np.array_equal(full["movie"], other["movie"])
    keys = set(zip(full["user"].tolist(), full["movie"].tolist()))
    assert len(keys) == len(full_labels)        # (user, movie) identifies a rating here
    seen = set()
    for r in range(3):
        part, _ = collect(movielens_dataset(ml_dir, 1000, num_shards=3, shard_index=r, seed=5))
        np.testing.assert_array_equal(part["movie"], full["movie"][r::3])
        mine = set(zip(part["user"].tolist(), part["movie"].tolist()))
        assert not mine & seen
        seen |= mine
    assert seen == keys

    ds = movielens_dataset(ml_dir, 256, history_len=5, drop_remainder=True)
    spec = ds.element_spec[0]
    for name in ("genres", "history"):
        assert isinstance(spec[name], tf.RaggedTensorSpec) and spec[name].dtype == tf.int64
        assert spec[name].shape.as_list() == [256, None]

    @tf.function
    def stats(dataset):
        longest = total = n = tf.constant(0, tf.int64)
        for feats, _ in dataset:
            lengths = feats["history"].row_lengths()
            longest = tf.maximum(longest, tf.reduce_max(lengths))
            total += tf.reduce_sum(lengths)
            n += tf.size(feats["user"], out_type=tf.int64)
        return longest, total, n

    longest, total, n = stats(ds)
    assert int(longest) == 5 and int(n) == (len(full_labels) // 256) * 256
    assert 4 * int(n) < int(total) <= 5 * int(n)


# ------------------------------------------------------------------------------------------ Avazu
def test_avazu_matches_python_parse(avazu_dir):
    path = str(avazu_dir / "train.csv")
    rows = list(csv.DictReader(open(path)))
    feats, labels = collect(avazu_dataset(path, 1000))
    assert len(labels) == len(rows) == 8087
    np.testing.assert_array_equal(labels, [float(r["click"]) for r in rows])
    for name in AVAZU_CATEGORICAL:
        values = [r[name] for r in rows[:500]]
        # Fingerprint64 (tf.fingerprint, little-endian bytes) mod 2**62, computed independently
        fp = [int.from_bytes(bytes(b), "little") % 2 ** 62
              for b in tf.fingerprint(values).numpy()]
        assert feats[name][:500].tolist() == fp, name
    assert feats["hour_of_day"].tolist() == [int(r["hour"][-2:]) for r in rows]
    assert feats["site_id"][0] != feats["site_domain"][0]


def test_avazu_headerless_sharding(avazu_dir):
    dev = str(avazu_dir / "dev.csv")            # no header line
    n_lines = sum(1 for _ in open(dev))
    full, labels = collect(avazu_dataset(dev, 100, hour_of_day=False))
    assert len(labels) == n_lines and "hour_of_day" not in full
    parts = [collect(avazu_dataset(dev, 64, num_shards=2, shard_index=r)) for r in range(2)]
    for r, (feats, _) in enumerate(parts):
        np.testing.assert_array_equal(feats["device_ip"], full["device_ip"][r::2])
    both, _ = collect(avazu_dataset([str(avazu_dir / "train.csv"), dev], 4096))
    assert len(both["C1"]) == 8087 + n_lines


# --------------------------------------------------------------------------------------- pipeline
def test_equal_steps_and_ragged_batch(tmp_path):
    for shards in (1, 2, 4):
        for drop in (False, True):
            parts = [list(pipeline.shard_shuffle_batch(tf.data.Dataset.range(23), 3, shards, r,
                                                       drop_remainder=drop).as_numpy_iterator())
                     for r in range(shards)]
            assert pipeline.equal_steps(23, 3, shards, drop) == min(len(p) for p in parts)
            rows = sorted(int(x) for p in parts for b in p for x in b)
            assert len(set(rows)) == len(rows) and set(rows) <= set(range(23))
            assert drop or rows == list(range(23))
    ds = tf.data.Dataset.range(5).map(lambda i: tf.range(i))
    batches = [b.to_list() for b in pipeline.batch(ds, 2)]
    assert batches == [[[], [0]], [[0, 1], [0, 1, 2]], [[0, 1, 2, 3]]]
    path = tmp_path / "lines.txt"
    path.write_text("a\n" * 22 + "a")                  # the last line has no newline
    assert pipeline.count_lines([str(path)]) == 23


@pytest.mark.parametrize("rows,batch,repeat,drop", [
    (1003, 64, True, True), (1003, 64, False, True), (1003, 64, False, False),
    (10, 64, True, True), (0, 8, False, False), (128, 64, False, False)])
def test_array_batches_equal_tf_data_batching(rows, batch, repeat, drop):
    """The same batches, in the same order and with the same static shapes, as tf.data's
    own from_tensor_slices[.repeat()].batch(), including wrap-around across epochs."""
    rng = np.random.default_rng(rows)
    arrays = ({"ids": rng.integers(-2**62, 2**62, size=rows, dtype=np.int64),
               "dense": rng.random((rows, 3)).astype(np.float32)},
              rng.random((rows, 1)).astype(np.float32))
    ref = tf.data.Dataset.from_tensor_slices(arrays)
    ref = (ref.repeat() if repeat else ref).batch(batch, drop_remainder=drop)
    got = pipeline.array_batches(arrays, batch, repeat=repeat, drop_remainder=drop)
    assert got.element_spec == ref.element_spec
    want = list(ref.take(40))
    have = list(got.take(40))
    assert len(have) == len(want)
    for w, h in zip(want, have):
        for a, b in zip(tf.nest.flatten(w), tf.nest.flatten(h)):
            np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_array_batches_bad_input():
    with pytest.raises(ValueError, match="first dimension"):
        pipeline.array_batches((np.zeros(3), np.zeros(4)), 2)
    with pytest.raises(ValueError, match="positive"):
        pipeline.array_batches(np.zeros(3), 0)
    with pytest.raises(ValueError, match="zero rows"):
        pipeline.array_batches(np.zeros(0), 2, repeat=True)
