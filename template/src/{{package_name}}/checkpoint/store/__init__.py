"""Where checkpoints live: the storage, the commit protocol, checksums, the lease, outages."""
