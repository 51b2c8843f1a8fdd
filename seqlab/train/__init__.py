"""Generic training plumbing: data, model registry, optimizer, train/eval steps, device mesh and
sharding, checkpoints (the only orbax import) and the metrics writer. The entry point that puts
them together is `python -m experiments.launch`."""
