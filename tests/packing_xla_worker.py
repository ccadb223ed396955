"""Issue 15's packing checks on XLA:CPU, in one fresh process (tests/integration/test_packing_xla.py): for tiny
BERT and tiny Llama, the largest difference in the other documents' outputs when one document changes (with
and without document boundaries), and the largest packed-vs-alone differences. Prints one JSON line."""

import json
import time

from packing_models import equivalence, first_documents, isolation, tiny_model

from neurontrain.backends import select_backend


def main() -> None:
    backend = select_backend("xla-cpu")
    started = time.perf_counter()
    firsts = first_documents()
    report = {}
    for model_type in ("bert", "llama"):
        model = tiny_model(model_type).to(backend.device)
        report[model_type] = {
            "isolation": max(r.max_diff for r in isolation(model, backend)),
            "without_boundaries": min(r.max_diff for r in isolation(model, backend, firsts, erase_boundaries=True)),
            "equivalence": equivalence(model, backend),
        }
    report["device"] = str(backend.device)
    report["compiles"] = backend.compile_count()
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
