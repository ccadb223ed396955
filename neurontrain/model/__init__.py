"""The model a run trains: built from the recipe (`build.py`), the inputs its forward takes (`inputs.py`, decided
by `input_probe.py`'s checks), per-document masks and heads of packed rows (`packed.py`)."""
