"""The training state's save planner: DCP's plan caching, kept from thrashing."""

import torch.distributed.checkpoint as dcp


class TrainingStatePlanner(dcp.DefaultSavePlanner):
    """The save planner of the training state, with DCP's plan caching on.

    DCP keeps one cached plan per planner class: the training state has this class to
    itself, so a differently shaped save (the start-up save, an export) never evicts its
    plan. ``cache_hits`` counts, in the process that plans (this one in ``thread`` and
    ``sync`` mode, the checkpoint process in ``process`` mode), the saves whose local plan
    came from the cache.
    """

    cache_hits = 0

    def create_local_plan(self):
        plan = super().create_local_plan()
        if not plan.usable:  # DCP's mark for "unchanged since the cached plan"
            type(self).cache_hits += 1
        return plan
