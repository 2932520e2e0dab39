"""Where checkpoints live: the storage, the layout (how a checkpoint is named, committed
and retired), checksums, the lease, outages."""
