"""The row optimizer and row initializer of a table: names, hyper-parameters with the
tf.keras defaults, and their optimizer slots."""
from __future__ import annotations

import dataclasses
from typing import Mapping

from tf_fusedemb.specs.validation import HParams, canonical, fail, number

# Hyper-parameter defaults follow tf.keras optimizers (Adam epsilon 1e-7, accumulators 0.1).
OPTIMIZERS = {
    "sgd": {},
    "adagrad": {"initial_accumulator_value": 0.1},
    "adam": {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-7},
    "ftrl": {"learning_rate_power": -0.5, "initial_accumulator_value": 0.1, "l1": 0.0, "l2": 0.0},
}
SLOTS = {"sgd": (), "adagrad": ("accumulator",), "adam": ("m", "v"), "ftrl": ("accumulator", "linear")}
INITIALIZERS = {
    "uniform": {"minval": -0.05, "maxval": 0.05},  # tf.keras.layers.Embedding's default
    "normal": {"mean": 0.0, "stddev": 0.05},
    "truncated_normal": {"mean": 0.0, "stddev": 0.05},
    "zeros": {},
}


@dataclasses.dataclass(frozen=True, order=True)
class OptimizerSpec:
    """Sparse optimizer of a table; part of the fusion key (hashable, ordered).

    Args:
        name: one of "sgd", "adagrad", "adam", "ftrl".
        learning_rate: float > 0.
        params: hyper-parameters, a mapping or (key, value) pairs; missing ones take the
            tf.keras defaults, so ``OptimizerSpec("adam", 1e-3) == OptimizerSpec.adam(1e-3)``.
            Stored as a sorted tuple of (key, float) pairs.

    Example::

        >>> OptimizerSpec.adam(1e-3, beta1=0.8).hparams["beta1"]
        0.8
        >>> OptimizerSpec.ftrl(0.1).slot_names
        ('accumulator', 'linear')
    """
    name: str
    learning_rate: float
    params: HParams = ()

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            fail("OptimizerSpec", self.name, f"name is not one of {tuple(OPTIMIZERS)}")
        lr = number("OptimizerSpec", self.name, "learning_rate", self.learning_rate)
        if lr <= 0:
            fail("OptimizerSpec", self.name, f"learning_rate must be > 0, got {self.learning_rate!r}")
        object.__setattr__(self, "learning_rate", lr)
        object.__setattr__(self, "params", canonical(
            "OptimizerSpec", self.name, OPTIMIZERS[self.name], self.params))

    @classmethod
    def sgd(cls, learning_rate: float) -> "OptimizerSpec":
        return cls("sgd", learning_rate)

    @classmethod
    def adagrad(cls, learning_rate: float, initial_accumulator_value: float = 0.1) -> "OptimizerSpec":
        return cls("adagrad", learning_rate, {"initial_accumulator_value": initial_accumulator_value})

    @classmethod
    def adam(cls, learning_rate: float, beta1: float = 0.9, beta2: float = 0.999,
             epsilon: float = 1e-7) -> "OptimizerSpec":
        """Lazy (row-wise) Adam: Keras's Adam formula (``tf_keras.optimizers.Adam``, same
        defaults) applied to the rows a batch touched only, with the bias correction of
        the table's step counter (one step per batch).

        How it differs from Keras's Adam on an ``Embedding``: Keras keeps updating every
        row at every step (untouched rows still move by their decaying momentum ``m``);
        here an untouched row and its ``m``/``v`` stay exactly as they are (as in
        tensorflow_addons' LazyAdam and TFRA/SOK sparse Adam). Training equals Keras's
        Adam when every row is touched at every step, and otherwise differs by design
        (tested against Keras's formula on the touched rows)."""
        return cls("adam", learning_rate, {"beta1": beta1, "beta2": beta2, "epsilon": epsilon})

    @classmethod
    def ftrl(cls, learning_rate: float, learning_rate_power: float = -0.5,
             initial_accumulator_value: float = 0.1, l1: float = 0.0, l2: float = 0.0) -> "OptimizerSpec":
        return cls("ftrl", learning_rate, {"learning_rate_power": learning_rate_power, "l1": l1, "l2": l2,
                                           "initial_accumulator_value": initial_accumulator_value})

    @property
    def hparams(self) -> dict:
        return dict(self.params)

    @property
    def counts_steps(self) -> bool:
        """Whether the row update reads the group's step counter (Adam's bias correction),
        so that a group must step once per training step, not once per feature."""
        return self.name == "adam"

    @property
    def slot_names(self) -> tuple:
        """Per-row optimizer state kept next to each embedding row, e.g. ("m", "v") for adam."""
        return SLOTS[self.name]

    def to_dict(self) -> dict:
        return {"name": self.name, "learning_rate": self.learning_rate, "params": self.hparams}

    @classmethod
    def from_dict(cls, d: Mapping) -> "OptimizerSpec":
        return cls(d["name"], d["learning_rate"], d.get("params", {}))


@dataclasses.dataclass(frozen=True, order=True)
class InitializerSpec:
    """Initial value distribution of new rows; part of the fusion key.

    Args:
        name: one of "uniform" (minval < maxval), "normal" / "truncated_normal" (mean,
            stddev > 0), "zeros".
        params: mapping or (key, value) pairs; missing ones take the defaults
            (uniform(-0.05, 0.05) and stddev 0.05, like tf.keras).

    Example::

        >>> InitializerSpec.normal(stddev=0.01).hparams
        {'mean': 0.0, 'stddev': 0.01}
    """
    name: str = "uniform"
    params: HParams = ()

    def __post_init__(self) -> None:
        if self.name not in INITIALIZERS:
            fail("InitializerSpec", self.name, f"name is not one of {tuple(INITIALIZERS)}")
        params = canonical("InitializerSpec", self.name, INITIALIZERS[self.name], self.params)
        object.__setattr__(self, "params", params)
        p = dict(params)
        if self.name == "uniform" and not p["minval"] < p["maxval"]:
            fail("InitializerSpec", self.name, f"minval must be < maxval, got {p['minval']} >= {p['maxval']}")

    @classmethod
    def uniform(cls, minval: float = -0.05, maxval: float = 0.05) -> "InitializerSpec":
        return cls("uniform", {"minval": minval, "maxval": maxval})

    @classmethod
    def normal(cls, mean: float = 0.0, stddev: float = 0.05) -> "InitializerSpec":
        return cls("normal", {"mean": mean, "stddev": stddev})

    @classmethod
    def truncated_normal(cls, mean: float = 0.0, stddev: float = 0.05) -> "InitializerSpec":
        return cls("truncated_normal", {"mean": mean, "stddev": stddev})

    @classmethod
    def zeros(cls) -> "InitializerSpec":
        return cls("zeros")

    @property
    def hparams(self) -> dict:
        return dict(self.params)

    def to_dict(self) -> dict:
        return {"name": self.name, "params": self.hparams}

    @classmethod
    def from_dict(cls, d: Mapping) -> "InitializerSpec":
        return cls(d["name"], d.get("params", {}))
