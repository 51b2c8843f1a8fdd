"""This paper's claims only: `python -m theory.mamba_dynamics [--out DIR] [--full] [--only ID]`."""

from absl import app

from theory import runner

if __name__ == "__main__":
    app.run(runner.main_for(["mamba_dynamics"]))
