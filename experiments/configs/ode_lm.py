"""A neural-ODE transformer (Tong et al., arXiv 2503.01329; `seqlab.modules.ode_transformer`)
trained as a byte-level language model on `lm.py`'s corpus (the Python sources of `seqlab/`).

Arg: comma-separated `steps=N` (Euler steps on t in [0, 1] during training, default 12),
`runlocal` (seconds on a CPU; 2 Euler steps unless `steps` is given).

    python -m experiments.launch --config=experiments/configs/ode_lm.py --workdir=/tmp/ode-lm

trains a width-64 model (4 heads, MLP width 256, time networks of width 32 over 8 frequencies)
integrated with 12 Euler steps, for 1500 steps of 16 x 128 bytes (AdamW, lr 3e-3, cosine).
Measured (2026-12-03, 2 shared CPU cores, about 10 minutes at 2.7 steps/s): training loss 3.49
at step 50, 2.27 at 250, 1.22 at 1500; held-out `eval/loss` 2.44 at 250, 1.95 at 1000, 1.85
(accuracy 0.51) at 1500. Fine-tune it at another step count with `ode_finetune.py`.

    python -m experiments.launch --config=experiments/configs/ode_lm.py:runlocal --workdir=/tmp/o

runs a width-16 model with 2 Euler steps for 8 steps (seconds; loss near log(256) ≈ 5.5).
"""

from experiments.configs import lm
from experiments.configs.base import parse_arg


def get_config(arg: str | None = None):
    """The run of `arg` (module docstring)."""
    args = parse_arg(arg, {"steps": int, "runlocal": False})
    config = lm.get_config("model=ode_transformer" + (",runlocal" if args["runlocal"] else ""))
    steps = args["steps"]
    if args["runlocal"]:
        config.model.update(d_model=16, num_layers=2 if steps is None else steps, d_ff=32)
        config.model.ode.update(num_heads=2, time_features=4, hidden=8)
        return config
    config.model.update(d_model=64, num_layers=12 if steps is None else steps, d_ff=256)
    config.model.ode.update(num_heads=4, time_features=8, hidden=32)
    config.data.seq_len = 128
    config.update(total_steps=1500, checkpoint_every=250, eval_every=250)
    config.optimizer.learning_rate = 3e-3
    return config
