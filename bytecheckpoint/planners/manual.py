"""Hand-described layouts: Megatron-LM, veScale, custom tensor/pipeline parallelism.

The state holds dicts whose leaves are :class:`~bytecheckpoint.state.tensor_shard.TensorShard` (or
megatron-core ``ShardedTensor``): each names its global shape, offset, optional flattened
range (a distributed optimizer's slice) and replica id. Every planner understands those;
this one adds nothing but a name, treats plain tensors as replicated, and works with or
without a process group.
"""

from __future__ import annotations

from .ddp import DDPPlanner


class ManualPlanner(DDPPlanner):
    name = "manual"
