"""Benchmarks: ``python -m tf_fusedemb.benchmarks.<name> --json``.

Each prints a JSON object as its last line. Variants are timed side by side in one run,
interleaved, and compared by ratios, because these machines are shared and noisy.
"""
