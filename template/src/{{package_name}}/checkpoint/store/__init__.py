"""Where checkpoints live: storage, layout (naming, commit, retiring), checksums, lease, outages."""
