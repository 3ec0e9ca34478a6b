"""The Python API example in README.md runs as written (against two real shards on loopback)."""

import re

import torch

from psserver.codegen import REPO_ROOT


def readme_python_example() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README.md has no python example"
    return next(b for b in blocks if "connect(" in b)


def test_readme_python_api_example_trains(shard_server):
    shards = [shard_server(shard=i) for i in range(2)]
    code = readme_python_example()
    assert '"127.0.0.1:7000,127.0.0.1:7001"' in code
    code = code.replace("127.0.0.1:7000,127.0.0.1:7001", ",".join(s.server.address for s in shards))
    code = code.replace("range(2)", "range(1)")  # one epoch is enough to see it learn
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    model, data = namespace["model"], namespace["data"]
    with torch.no_grad():
        acc = (model(data.x_test).argmax(1) == data.y_test).float().mean().item()
    assert acc > 0.85
    stats = [s.stats() for s in shards]
    assert [s.version for s in stats] == [63, 63]  # ceil(4000 / 64) steps, one round each
    assert all(list(s.live_ranks) == [] for s in stats)  # close() left the job
