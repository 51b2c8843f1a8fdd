"""Fine-tune a neural-ODE transformer trained by `ode_lm.py` at another Euler step count, fully
or with LoRA (Tong et al., arXiv 2503.01329, section 6).

Arg: comma-separated `from=WORKDIR` (the `ode_lm.py` run whose latest checkpoint gives the
parameters; the model sizes must be those of that run), `steps=N` (the new step count, default
24), `lora=R` (LoRA rank; 0, the default, fine-tunes every parameter; R > 0 adds a
time-independent `U V^T` to every attention and MLP weight and trains only those factors),
`runlocal` (seconds on a CPU).

    python -m experiments.launch --config=experiments/configs/ode_lm.py --workdir=/tmp/ode-lm
    python -m experiments.launch \
        --config=experiments/configs/ode_finetune.py:from=/tmp/ode-lm,steps=24,lora=4 \
        --workdir=/tmp/ode-ft24-lora4

starts at step 0 with a fresh optimizer from the parameters of /tmp/ode-lm's latest checkpoint
(the LoRA factors at their init, so the first loss is the source model's loss at 24 steps), and
trains for 300 steps (AdamW, lr 1e-3 for LoRA, 3e-4 for full fine-tuning). Relaunching resumes
from the run's own checkpoints, not from `from`. Measured (2026-12-03, 2 shared CPU cores, about
3.5 minutes each) from the `ode_lm.py` run above (held-out loss 1.85 at its 12 steps), at 24
steps: the first training loss is 2.19 (the model resampled at 24 steps is much worse); LoRA rank
4 reaches held-out loss 2.19 / 2.15 / 2.14 at steps 100 / 200 / 300, full fine-tuning (`lora=0`)
1.87 / 1.85 / 1.85, back to the source's loss at 12 steps.

    python -m experiments.launch --config=experiments/configs/ode_finetune.py:runlocal,lora=2 \
        --workdir=/tmp/oft

runs `ode_lm.py:runlocal`'s model for 4 steps at 3 Euler steps, from `from=` when given and from
a fresh initialization otherwise (seconds).
"""

from experiments.configs import ode_lm
from experiments.configs.base import parse_arg, runlocal


def get_config(arg: str | None = None):
    """The fine-tuning run of `arg` (module docstring)."""
    args = parse_arg(arg, {"from": "", "steps": int, "lora": 0, "runlocal": False})
    config = ode_lm.get_config("runlocal" if args["runlocal"] else None)
    lora = args["lora"]
    config.init_from = args["from"]
    steps = args["steps"]
    config.model.num_layers = (3 if args["runlocal"] else 24) if steps is None else steps
    config.model.ode.lora_rank = lora
    config.optimizer.update(
        trainable="lora" if lora else "",
        learning_rate=1e-3 if lora else 3e-4,
        weight_decay=0.0,
        warmup_steps=20,
    )
    config.update(total_steps=300, checkpoint_every=100, eval_every=100, log_every=10)
    if args["runlocal"]:
        runlocal(config, total_steps=4, log_every=1, warmup_steps=1)
    return config
