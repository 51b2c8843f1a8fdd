"""Experiments: `python -m experiments.launch` trains any seqlab model from a config in
`experiments/configs/`; `python -m experiments.plot` draws its curves."""
