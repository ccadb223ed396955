"""Recompilation guard: every compile is attributed to the step that caused it and checked against the plan."""

from __future__ import annotations

from collections.abc import Callable

from neurontrain.errors import RecompilationError
from neurontrain.logs import get_logger

log = get_logger(__name__)


class RecompilationGuard:
    """After each sync, compare the compile and execution counters with the step's graph key.

    A compile is expected the first time a key from the plan runs. A compile for a key that already
    compiled, or for a key the plan does not list, is an unexpected graph: reported with the shapes that
    caused it, and fatal when mode is "fail". More than one graph execution in one step means a hidden host
    sync (for example `.item()` or data-dependent Python control flow inside the model).

    On the native backend the compile counter is TorchDynamo's graph count, and `explain` gives what
    TorchDynamo says about the new graphs (recompile reasons, graph breaks): they go with the report. There a
    planned key that runs for the first time without compiling anything ran eagerly (TorchDynamo falls back to
    eager without an error, e.g. past its `recompile_limit`): reported as a planned graph that never compiled.
    """

    def __init__(
        self,
        expected: list[tuple],
        mode: str,
        compile_count: Callable[[], int],
        execute_count: Callable[[], int],
        report: Callable[[str], None] | None = None,
        known_graphs: set[str] | None = None,
        explain: Callable[[], list[str]] | None = None,
        graphs_per_key: int = 1,
        compile_seconds: Callable[[], float] | None = None,
        compiles_new_keys: bool = False,
    ) -> None:
        """known_graphs: graph ids from a precompile manifest; when given, a compiled graph must be one of them.
        explain: why the graphs since its last call compiled (each call reports only what is new).
        graphs_per_key: graphs one key compiles (native FSDP2: one per layer). compile_seconds: the backend's
        compile-seconds counter, for the compile timeline (`timeline`: one entry per sync that compiled).
        compiles_new_keys: every planned key compiles the first time it runs (native: TorchDynamo traces it even
        when its code comes from a cache)."""
        self.expected = set(expected)
        self.known_graphs = known_graphs
        self.mode = mode
        self._compiles = compile_count
        self._executes = execute_count
        self._report = report or log.warning
        self._explain = explain or list
        self.graphs_per_key = graphs_per_key
        self.compiles_new_keys = compiles_new_keys
        self.uncompiled: list[dict] = []  # planned keys that ran for the first time without a compile
        self._ran: set[tuple] = set()
        self._last_compiles = compile_count()
        self._executes_at_start = execute_count()
        self._syncs = 0
        self.compiled: dict[tuple, int] = {}
        self.unexpected: list[dict] = []
        self.hidden_syncs: list[dict] = []
        self._synced_keys_reported: set[tuple] = set()
        self._extra_reported = 0
        self._seconds = compile_seconds or (lambda: 0.0)
        self._last_seconds = self._seconds()
        self.timeline: list[dict] = []
        self.last_unexpected: dict | None = None  # the last sync's unexpected graph, whatever the mode
        self.last_seconds = 0.0  # the last sync's compile seconds

    def after_sync(
        self, key: tuple, step: int, shapes: dict | None = None, syncs: int = 1, graph: str | None = None
    ) -> None:
        compiles = self._compiles()
        new_compiles = compiles - self._last_compiles
        self._last_compiles, self.last_unexpected = compiles, None
        self._syncs += syncs
        # Executions run asynchronously and are counted when they run, so compare running totals: more
        # executions than syncs so far can only come from syncs that the loop did not make.
        extra_executions = self._executes() - self._executes_at_start - self._syncs
        why = self._explain() if new_compiles > 0 else []
        if new_compiles == 0 and key not in self._ran:
            self._check_compiled(key, step, shapes)
        self._ran.add(key)
        if new_compiles > 0:
            first_time = key not in self.compiled
            self._record_compile(key, step, new_compiles, expected=first_time and key in self.expected)
            self.compiled[key] = self.compiled.get(key, 0) + new_compiles
            unlisted = self.known_graphs is not None and graph is not None and graph not in self.known_graphs
            too_many = new_compiles > syncs * self.graphs_per_key
            if not first_time or key not in self.expected or too_many or unlisted:
                event = {
                    "step": step,
                    "kind": key[0],
                    "key": list(key),
                    "shapes": shapes or {},
                    "new_compiles": new_compiles,
                    "graph": graph,
                    "reason": "not in the plan"
                    if key not in self.expected
                    else (
                        "recompiled a graph already compiled"
                        if not first_time
                        else "more graphs than syncs"
                        if too_many
                        else "not in the precompile manifest"
                    ),
                    **({"why": why} if why else {}),
                }
                self.last_unexpected = event
                if self.mode == "off":
                    return
                self.unexpected.append(event)
                message = (
                    f"unexpected graph at step {step} ({key[0]}, shapes {shapes or {}}): "
                    f"{event['reason']}, {new_compiles} compile(s)" + "".join(f"; {w}" for w in why)
                )
                if self.mode == "fail":
                    raise RecompilationError(message + " (train.recompile_guard: fail)")
                self._report(message)
        if extra_executions > self._extra_reported and self.mode != "off":
            self.hidden_syncs.append({"step": step, "kind": key[0], "extra_executions": extra_executions})
            if key not in self._synced_keys_reported:
                self._report(
                    f"{extra_executions - self._extra_reported} graph execution(s) beyond the "
                    f"loop's syncs by step {step} ({key[0]}): a host sync inside the step "
                    "(.item(), print(tensor), data-dependent Python control flow)"
                )
            self._synced_keys_reported.add(key)
            self._extra_reported = extra_executions

    def _record_compile(self, key: tuple, step: int, graphs: int, expected: bool) -> None:
        seconds = self._seconds()
        entry = {"step": step, "key": [str(k) for k in key], "graphs": graphs, "expected": expected}
        self.last_seconds = seconds - self._last_seconds
        self.timeline.append({**entry, "seconds": round(self.last_seconds, 4)})
        self._last_seconds = seconds

    def _check_compiled(self, key: tuple, step: int, shapes: dict | None) -> None:
        if not self.compiles_new_keys or key not in self.expected or self.mode == "off":
            return
        event = {"step": step, "kind": key[0], "key": list(key), "shapes": shapes or {}}
        self.uncompiled.append(event)
        message = (
            f"planned graph never compiled at step {step} ({key[0]}, shapes {shapes or {}}): it ran eagerly "
            "(TorchDynamo's silent fallback, e.g. past torch._dynamo.config.recompile_limit)"
        )
        if self.mode == "fail":
            raise RecompilationError(message + " (train.recompile_guard: fail)")
        self._report(message)

    @property
    def distinct_graphs(self) -> int:
        return sum(self.compiled.values())
