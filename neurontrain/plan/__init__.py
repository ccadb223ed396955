"""What a run will do, known before any step runs: the run plan (`planning.py`: `make_plan`, `RunPlan`), its
sequence lengths (`buckets.py`), whether and how it packs rows (`packing.py`), the memory planner's inputs and
choice (`memory_inputs.py`), and the plan as `run --dry-run` prints it (`description.py`)."""
