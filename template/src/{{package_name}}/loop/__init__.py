"""The training loop: the trainer, the job around it, sampling, parallelism, the task contract."""
