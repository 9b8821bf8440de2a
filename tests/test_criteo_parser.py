"""Every Criteo consumer (tf.data reader, numpy reader, profile fit, both benchmarks) reads
missing values the same way, checked against a hand-written expectation of a small TSV."""
import numpy as np
import pytest
import tensorflow as tf

from tf_fusedemb.benchmarks import lookup_data
from tf_fusedemb.benchmarks.ops import criteo_file_keys
from tf_fusedemb.data import MISSING_ID
from tf_fusedemb.data.criteo import (CRITEO_CATEGORICAL, CRITEO_DENSE, criteo_dataset,
                                     read_criteo)
from tf_fusedemb.data.fit_profile import fit_criteo

# Three lines: empty dense cells (I1 of line 1, I1..I13 of line 2), a negative I2, empty
# categorical cells (C2 of line 1, C1..C26 of line 3) and a real "00000000".
LINES = [
    ["1", "", "-3", "7"] + ["2"] * 10 + ["68fd1e64", "", "00000000"] + ["ab"] * 23,
    ["0"] + [""] * 13 + ["FFFFFFFF"] * 26,
    ["1"] + ["5"] * 13 + [""] * 26,
]
# Written by hand from the rules (empty dense -> 0, empty categorical -> MISSING_ID = 0).
RAW_DENSE = np.array([[0, -3, 7] + [2] * 10, [0] * 13, [5] * 13], np.float32)
IDS = np.array([[0x68FD1E64, MISSING_ID, 0] + [0xAB] * 23, [0xFFFFFFFF] * 26, [MISSING_ID] * 26],
               np.int64)
LABELS = np.array([1.0, 0.0, 1.0], np.float32)
MISSING_DENSE = np.array([[True] + [False] * 12, [True] * 13, [False] * 13])
MISSING_CAT = np.array([[False, True] + [False] * 24, [False] * 26, [True] * 26])


@pytest.fixture
def tsv(tmp_path):
    path = tmp_path / "sample.tsv"
    path.write_text("".join("\t".join(line) + "\n" for line in LINES))
    return str(path)


def test_tf_data_reader_matches_hand_written(tsv):
    (feats, label), = list(criteo_dataset(tsv, 8).as_numpy_iterator())
    np.testing.assert_array_equal(label[:, 0], LABELS)
    for k, name in enumerate(CRITEO_DENSE):
        np.testing.assert_allclose(feats[name], np.log1p(np.maximum(RAW_DENSE[:, k], 0)),
                                   rtol=1e-6, err_msg=name)
    for k, name in enumerate(CRITEO_CATEGORICAL):
        np.testing.assert_array_equal(feats[name], IDS[:, k], err_msg=name)


def test_numpy_reader_matches_hand_written(tsv):
    cols = read_criteo(tsv, with_missing=True)
    np.testing.assert_array_equal(cols["label"], LABELS)
    for k, name in enumerate(CRITEO_DENSE):
        assert cols[name].dtype == np.float32
        np.testing.assert_array_equal(cols[name], RAW_DENSE[:, k], err_msg=name)
        np.testing.assert_array_equal(cols["missing"][name], MISSING_DENSE[:, k], err_msg=name)
    for k, name in enumerate(CRITEO_CATEGORICAL):
        assert cols[name].dtype == np.int64
        np.testing.assert_array_equal(cols[name], IDS[:, k], err_msg=name)
        np.testing.assert_array_equal(cols["missing"][name], MISSING_CAT[:, k], err_msg=name)
    assert len(read_criteo(tsv, max_rows=2)["label"]) == 2
    np.testing.assert_allclose(read_criteo(tsv, log1p=True)["I3"], np.log1p([7.0, 0.0, 5.0]),
                               rtol=1e-6)


def test_benchmarks_read_the_same_values(tsv):
    keys, splits = criteo_file_keys(tsv, 8)
    np.testing.assert_array_equal(keys, IDS.T.reshape(-1))   # category-major fused layout
    np.testing.assert_array_equal(splits, np.arange(27) * 3)
    (x, y), = lookup_data.make_batches(lookup_data.read_criteo(tsv), 3, 1, 0, 1)
    np.testing.assert_array_equal(y[:, 0], LABELS)
    np.testing.assert_allclose(x["dense"], np.log1p(np.maximum(RAW_DENSE, 0)), rtol=1e-6)
    np.testing.assert_array_equal(np.stack([x[c] for c in CRITEO_CATEGORICAL], 1), IDS)


def test_profile_fit_counts_empty_cells_not_zeros(tsv):
    profile = fit_criteo(tsv)
    dense = {d.name: d for d in profile.dense}
    cat = {c.name: c for c in profile.categorical}
    assert dense["I1"].empty_fraction == pytest.approx(2 / 3, abs=1e-6)   # empty, not zero
    assert dense["I1"].zero_fraction == 0.0
    assert dense["I2"].negative_fraction == pytest.approx(1 / 2) and dense["I2"].negative_min == -3
    assert cat["C2"].empty_fraction == pytest.approx(2 / 3, abs=1e-6)
    assert cat["C3"].empty_fraction == pytest.approx(1 / 3, abs=1e-6)    # "00000000" is a value
    assert cat["C3"].observed_cardinality == 2
    assert profile.label_positive_rate == pytest.approx(2 / 3, abs=1e-6)


@pytest.mark.parametrize("reader", [read_criteo, lambda p: criteo_file_keys(p, 8),
                                    fit_criteo])
def test_every_reader_rejects_a_short_line_naming_it(tmp_path, reader):
    path = tmp_path / "bad.tsv"
    path.write_text("\t".join(LINES[0]) + "\n" + "\t".join(LINES[0][:30]) + "\n")
    with pytest.raises(tf.errors.InvalidArgumentError, match="bad.tsv line 2"):
        reader(str(path))
