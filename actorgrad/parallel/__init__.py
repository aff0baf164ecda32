"""Data parallelism: ``DistributedDataParallel`` over actorgrad collectives.

```python
ddp = await ag.parallel.DistributedDataParallel.create(model, bucket_cap_mb=25)
loss = loss_fn(ddp(x), y)
await ddp.backward(loss)        # local backward + bucketed all-reduce, overlapped
optimizer.step()
```
"""

from __future__ import annotations

from ._ddp import DistributedDataParallel as DistributedDataParallel

__all__ = ("DistributedDataParallel",)
