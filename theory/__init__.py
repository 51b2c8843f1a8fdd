"""Paper claims checked by running code: one package per paper, run by `python -m theory`.

`theory.registry` declares claims and lists the paper packages; `theory.runner` runs them and writes
the report (DESIGN.md 3.5).
"""
