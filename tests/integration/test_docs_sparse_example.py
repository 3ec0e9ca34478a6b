"""The sparse-table example in docs/sparse.md runs as written against two real shards and learns."""

import re

import torch
from torch.nn import functional as F

from psserver.codegen import REPO_ROOT


def readme_sparse_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (REPO_ROOT / "docs" / "sparse.md").read_text(), re.S)
    return next(b for b in blocks if "ShardedEmbeddingBag" in b and "connect(" in b)


def test_readme_sparse_example_trains_a_table_on_two_shards_and_beats_the_constant_predictor(shard_server):
    shards = [shard_server(shard=i) for i in range(2)]
    code = readme_sparse_example()
    assert '"127.0.0.1:7000,127.0.0.1:7001"' in code
    code = code.replace("127.0.0.1:7000,127.0.0.1:7001", ",".join(s.server.address for s in shards))
    namespace: dict = {}
    exec(compile(code, "docs/sparse.md", "exec"), namespace)
    held_out, logits = namespace["held_out"], namespace["logits"]
    learned = F.binary_cross_entropy_with_logits(logits, held_out.labels).item()
    rate = held_out.labels.mean()
    constant = F.binary_cross_entropy_with_logits(torch.logit(rate).expand(len(held_out.labels)), held_out.labels)
    assert learned < constant.item() - 0.02
    stats = [s.stats() for s in shards]
    assert all(s.counters["table.items.live_rows"] > 0 for s in stats)  # rows live on both shards
    assert [s.counters["table.items.version"] for s in stats] == [64.0, 64.0]  # async: one step per push
