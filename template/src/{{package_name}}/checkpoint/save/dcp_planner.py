"""The training state's save planner: DCP's plan caching, kept from thrashing."""

import torch.distributed.checkpoint as dcp


class TrainingStatePlanner(dcp.DefaultSavePlanner):
    """The training state's own planner class: DCP caches one plan per class, so another
    save (the start-up save, an export) never evicts it. ``cache_hits``: saves whose local
    plan came from the cache, in the process that plans (the checkpoint process in
    ``process`` mode)."""

    cache_hits = 0

    def create_local_plan(self):
        plan = super().create_local_plan()
        if not plan.usable:  # DCP's mark for "unchanged since the cached plan"
            type(self).cache_hits += 1
        return plan
