"""README's Python API example is docs/examples/quickstart.py, and the file runs as README says: against shards
it is given, and on its own (it starts two shards, prints its progress and result, and stops them)."""

import importlib.util
import re
import subprocess
import sys

from psserver.codegen import REPO_ROOT

EXAMPLE = REPO_ROOT / "docs" / "examples" / "quickstart.py"


def readme_python_example() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README.md has no python example"
    return next(b for b in blocks if "connect(" in b)


def quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_python_example_is_the_quickstart_files_code_line_for_line():
    file_lines = iter(EXAMPLE.read_text().splitlines())
    for line in readme_python_example().splitlines():
        if line.strip():
            # each README line is the file's next matching line: in the file, and in the same order
            assert any(line == f for f in file_lines), f"not in {EXAMPLE.name}, or out of its order: {line!r}"


def test_the_quickstart_trains_against_the_shards_it_is_given_and_leaves_the_job(shard_server, capsys):
    shards = [shard_server(shard=i) for i in range(2)]
    accuracy = quickstart().train(",".join(s.server.address for s in shards), steps=63)
    assert accuracy > 0.85
    assert "step 60/63  loss" in capsys.readouterr().out
    stats = [s.stats() for s in shards]
    assert [s.version for s in stats] == [63, 63]  # one round a step on each shard
    assert all(list(s.live_ranks) == [] for s in stats)  # leaving the with block left the job


def test_the_quickstart_file_starts_its_own_shards_prints_progress_and_its_accuracy_and_stops_them():
    run = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "30"], capture_output=True, text=True,
                         timeout=300, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert out.startswith("starting 2 shards on 127.0.0.1 ...\n"), out
    assert re.search(r"training for 30 steps with the shards at 127\.0\.0\.1:\d+,127\.0\.0\.1:\d+\n", out), out
    assert [int(s) for s in re.findall(r"^step (\d+)/30  loss \d+\.\d+$", out, re.M)] == [10, 20, 30], out
    accuracy = re.search(r"^test accuracy (\d\.\d{4}) after 30 steps$", out, re.M)
    assert accuracy and float(accuracy.group(1)) > 0.6, out  # 30 steps: well past chance (0.1)
