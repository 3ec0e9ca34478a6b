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


@pytest.fixture
def children(monkeypatch):
    """Every process trainer.tools.floors starts (floor servers and drivers, the step floor's echo servers), to
    check that each has exited once a measurement returns or raises."""
    from trainer.tools import floors
    started = []
    original = floors.Child.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        started.append(self)

    monkeypatch.setattr(floors.Child, "__init__", init)
    return started
