"""The documentation site: `python -m docs.build` (the site), `python -m docs.notebooks` (the
notebooks executed and committed with their outputs)."""
