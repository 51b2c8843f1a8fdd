"""Generic training plumbing: data, model registry, optimizer, train/eval steps, device mesh and
sharding, checkpoints (the only orbax import), the metrics writer, and the training loop
(`Trainer`) that puts them together. `python -m experiments.launch` drives it from a config;
`seqlab.train.aot` (ahead-of-time compilation for TPU topologies) is imported on its own.

    train_data, eval_data, vocab = make_datasets(data_block, batch_size=32, seed=0)
    model = build_model(model_block, vocab)
    tx = make_optimizer(optimizer_config(learning_rate=1e-2), total_steps=1000)
    trainer = Trainer(model, tx, train_data, eval_data, make_mesh(-1, 1), seq_len=64)
    trainer.run("runs/x", total_steps=1000, seed=0)
"""

from seqlab.train.checkpoint import Checkpointer, restore_params
from seqlab.train.data import DATASETS, Dataset, make_datasets
from seqlab.train.loop import Trainer
from seqlab.train.mesh import make_mesh, state_shardings
from seqlab.train.metrics import MetricsWriter, read_metrics
from seqlab.train.models import build_model, model_names
from seqlab.train.optim import make_optimizer, make_schedule, optimizer_config
from seqlab.train.step import TrainState, create_state, evaluate_batches, jit_steps

__all__ = [
    "DATASETS",
    "Checkpointer",
    "Dataset",
    "MetricsWriter",
    "TrainState",
    "Trainer",
    "build_model",
    "create_state",
    "evaluate_batches",
    "jit_steps",
    "make_datasets",
    "make_mesh",
    "make_optimizer",
    "make_schedule",
    "model_names",
    "optimizer_config",
    "read_metrics",
    "restore_params",
    "state_shardings",
]
