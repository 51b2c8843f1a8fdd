"""This paper's claims only: `python -m theory.neural_ode [--out DIR] [--full] [--only ID]`."""

from absl import app

from theory import runner

if __name__ == "__main__":
    app.run(runner.main_for(["neural_ode"]))
