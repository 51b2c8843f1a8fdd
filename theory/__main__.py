"""`python -m theory [--out DIR] [--full] [--only NAME[,NAME]]`: all papers' claims, one report."""

from absl import app

from theory import registry, runner

if __name__ == "__main__":
    app.run(runner.main_for(registry.PAPERS))
