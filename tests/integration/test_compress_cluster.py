"""Real processes: ps-trainer --compress topk:0.01 trains the CNN and pushes over 90% fewer bytes."""

from tests.cluster import helpers

STEPS = 60


def test_top_k_one_percent_trains_and_pushes_over_90_percent_fewer_bytes(tmp_path):
    job = None
    try:
        job = helpers.run_job(tmp_path, 2, 2, ["--model", "cnn", "--dataset", "mnist5k", "--steps", str(STEPS),
                                               "--compress", "topk:0.01", "--seed", "0"], timeout=600)
        assert set(job.codes.values()) == {0}, [t.log_tail() for t in job.trainers]
        for rank in range(2):
            done = job.done(rank)
            assert done["steps"] == STEPS
            assert done["push_bytes_sent"] <= 0.1 * done["push_bytes_dense"], done
            assert done["test_accuracy"] >= 0.5, done  # chance is 0.1; dense reaches ~0.75 in these steps
        for shard in range(2):
            counters = job.stats(shard).counters
            assert counters["topk_pushes"] == 2 * STEPS and not counters.get("refused_INVALID_ARGUMENT")
    finally:
        for p in (job.trainers + job.shards) if job else ():
            p.kill()
