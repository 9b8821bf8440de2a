"""The main job end to end: 2 Horovod workers on the embedded default (train, evaluate,
checkpoint, export, verified export), and a short real-data run that learns."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from horovod_launch import horovodrun


def parse(stdout):
    lines = [l for l in stdout.splitlines() if "RESULT " in l]
    assert lines, stdout[-3000:]
    return json.loads(lines[-1].split("RESULT ", 1)[1])


def _tensorboard_scalars(log_dir):
    """{tag: [(step, value)]} of the scalars tf.summary wrote under ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    events.Reload()
    import tensorflow as tf
    return {tag: [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)]
            for tag in events.Tags()["tensors"]}


@pytest.mark.timeout(900)
def test_two_workers_train_checkpoint_export_and_resume(tmp_path):
    args = ["-m", "tf_fusedemb.train", "--model", "dlrm", "--data", "synthetic", "--steps", "40",
            "--batch-size", "256", "--rows", "40000", "--checkpoint-every", "20",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--export-dir", str(tmp_path / "export"),
            "--log-dir", str(tmp_path / "tb")]
    result = parse(horovodrun(args, 2, timeout=800))
    assert result["world_size"] == 2 and result["steps"] == 40
    assert 0 < result["first_step_s"] < 300, result  # the trace plus the first step
    assert result["alltoall_rounds_per_step"] == {"g0_d16_adagrad": 3.0}
    assert result["eval_auc"] > 0.55, result  # teacher labels: learnable (ceiling ~0.88)
    assert result["export"]["max_abs_diff_vs_trained"] <= 1e-5
    assert result["export"]["checkpoint_step"] == 40
    # Exported from both workers: float32 rows serve the job's AUC; bf16 and int8 near it.
    auc = {d: r["eval_auc"] for d, r in result["export"]["row_dtypes"].items()}
    assert abs(auc["float32"] - result["eval_auc"]) < 1e-6, (auc, result["eval_auc"])
    assert abs(auc["bfloat16"] - auc["float32"]) <= 0.0005 and \
        abs(auc["int8"] - auc["float32"]) <= 0.002, auc
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["ckpt-20", "ckpt-40", "latest"]
    assert os.listdir(tmp_path / "tb")  # TensorBoard event file
    # The job's figures, not rank 0's: every sample looks up one ID per table per step.
    scalars = _tensorboard_scalars(tmp_path / "tb")
    for table in ("C1", "C26"):
        steps, counts = zip(*scalars[f"stats/g0_d16_adagrad/access/{table}"])
        assert list(counts) == [s * 2 * 256 for s in steps], (table, steps, counts)
    # Resuming past the last step trains nothing more and keeps the checkpoint's state.
    resumed = parse(horovodrun(args[:args.index("--export-dir")], 2, timeout=800))
    assert resumed["final_loss"] is None and abs(resumed["eval_auc"] - result["eval_auc"]) < 1e-6


@pytest.mark.timeout(900)
def test_real_criteo_sample_learns(shared_data):
    """DLRM on the Criteo sample's train.txt, evaluated on its test.txt (2000 rows)."""
    out = subprocess.run(
        [sys.executable, "-m", "tf_fusedemb.train", "--model", "dlrm", "--data", "criteo",
         "--data-path", str(shared_data / "criteo-kaggle-sample"), "--steps", "150",
         "--batch-size", "256", "--lr", "0.05"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=800,
        env={k: v for k, v in os.environ.items() if not k.startswith("HOROVOD")})
    assert out.returncode == 0, out.stderr[-3000:]
    result = parse(out.stdout)
    print("criteo sample eval:", result)
    assert result["eval_rows"] == 2000
    assert result["eval_auc"] > 0.62, result


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model,data,path,eval_rows", [
    ("sequence", "movielens", "movielens-latest-small", 9722),  # per-user last 10% of ratings
    ("dcn", "avazu", "avazu-sample/train.csv", 480),             # dev.csv
])
def test_main_job_runs_on_other_real_datasets(shared_data, model, data, path, eval_rows):
    out = subprocess.run(
        [sys.executable, "-m", "tf_fusedemb.train", "--model", model, "--data", data,
         "--data-path", str(shared_data / path), "--steps", "20", "--batch-size", "128"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=800,
        env={k: v for k, v in os.environ.items() if not k.startswith("HOROVOD")})
    assert out.returncode == 0, out.stderr[-3000:]
    result = parse(out.stdout)
    assert result["eval_rows"] == eval_rows
    assert 0.0 < result["eval_logloss"] < 1.0 and 0.0 <= result["eval_auc"] <= 1.0


@pytest.mark.timeout(900)
def test_pipelined_main_job_equals_synchronous(tmp_path):
    """``--pipeline dbp,fwp=4 --cluster-samples`` (2 workers, with a mid-run checkpoint that
    flushes the delayed rows) trains exactly like the synchronous loop: same final loss
    and evaluation to float tolerance."""
    base = ["-m", "tf_fusedemb.train", "--steps", "12", "--batch-size", "128", "--rows",
            "8000", "--checkpoint-every", "5"]
    sync = parse(horovodrun(base + ["--checkpoint-dir", str(tmp_path / "a")], 2, timeout=800))
    piped = parse(horovodrun(base + ["--checkpoint-dir", str(tmp_path / "b"), "--pipeline",
                                     "dbp,fwp=4", "--cluster-samples"], 2, timeout=800))
    # Per micro-batch: its keys (routed by the step before), rows and gradients; and the
    # last step routes an empty next batch, one key round per micro-batch.
    rounds = 12 * 4 * 3 + 4
    assert piped["alltoall_rounds_per_step"] == {"g0_d16_adagrad": pytest.approx(rounds / 12)}
    assert piped["final_loss"] == pytest.approx(sync["final_loss"], rel=1e-5)
    assert piped["eval_logloss"] == pytest.approx(sync["eval_logloss"], rel=1e-5)
    assert piped["eval_auc"] == pytest.approx(sync["eval_auc"], abs=1e-5)


@pytest.mark.timeout(900)
def test_measured_pipeline_reports_the_schedule_it_kept():
    """``--pipeline dbp,fwp=auto`` (one worker, 50 steps: 48 measuring the candidates, then
    the one kept) trains like the synchronous job, to float tolerance (micro-batches sum
    gradients in another order), and its RESULT names the schedule kept; a job with a
    fixed schedule names none."""
    base = ["-m", "tf_fusedemb.train", "--steps", "50", "--batch-size", "64", "--rows", "4000",
            "--eval-rows", "512"]
    sync = parse(horovodrun(base, 1, timeout=800))
    auto = parse(horovodrun(base + ["--pipeline", "dbp,fwp=auto"], 1, timeout=800))
    assert (sync["pipeline"], sync["pipeline_chosen"]) == ("sync", None)
    assert auto["pipeline"] == "dbp,fwp=auto"  # the schedule asked for, as --pipeline takes it
    assert auto["pipeline_chosen"] in ("sync", "dbp", "dbp,fwp=2", "dbp,fwp=4"), auto
    assert auto["final_loss"] == pytest.approx(sync["final_loss"], rel=1e-5)
    assert auto["eval_logloss"] == pytest.approx(sync["eval_logloss"], rel=1e-5)


@pytest.mark.timeout(900)
def test_main_job_with_a_memory_budget_equals_the_untiered_job(tmp_path):
    """``--memory-budget-mb`` a quarter of the table (2 workers, the synthetic main job;
    the budget over the blocks a step pins, about 224 KB per rank): the blocks beyond the
    budget are on the SSD tier, the loss and evaluation are bit-identical to the same job
    with every row in DRAM, and no store outlives the job. Both carry the feature of many
    IDs (``--wide-ids``: 3,000 IDs over 12 x 128 x 2 samples), whose table then holds
    every one of them."""
    base = ["-m", "tf_fusedemb.train", "--steps", "12", "--batch-size", "128", "--rows", "8000",
            "--wide-ids", "3000"]
    budget_mb = 0.4
    dram = parse(horovodrun(base, 2, timeout=800))
    tiered = parse(horovodrun(base + ["--memory-budget-mb", str(budget_mb), "--spill-dir",
                                      str(tmp_path / "spill")], 2, timeout=800))
    for key in ("final_loss", "train_auc", "eval_auc", "eval_logloss"):
        assert tiered[key] == dram[key], key
    # The workers exit with their tables alive: their stores are removed all the same.
    assert os.listdir(tmp_path / "spill") == []
    assert "embedding_memory_by_rank" not in dram
    for rank in tiered["embedding_memory_by_rank"]:
        group = rank["g0_d16_adagrad"]
        assert group["ssd_bytes"] > 2 * budget_mb * 2**20, group  # most blocks spilled
        assert group["bytes"] < group["ssd_bytes"] / 2, group  # DRAM stays the smaller tier
    rows = sum(rank["g0_d16_adagrad"]["rows"] for rank in tiered["embedding_memory_by_rank"])
    assert rows > 3000, rows  # W's 3,000 IDs beside the Criteo features' own
