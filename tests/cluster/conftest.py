import pytest

from tests.cluster import helpers


@pytest.fixture
def cluster(tmp_path):
    """``cluster(num_shards, num_trainers, args, ...)`` runs a job of real processes; all are stopped afterwards."""
    runs = []

    def run(*a, **kw):
        job = helpers.run_job(tmp_path, *a, **kw)
        runs.append(job)
        return job

    yield run
    for job in runs:
        for p in job.trainers + job.shards:
            p.kill()
