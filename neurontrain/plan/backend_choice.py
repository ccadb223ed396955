"""`auto` on a CUDA host without torch-xla: eager PyTorch or native (`torch.compile`, inductor), whichever the whole
job costs less on. Native's compiles are priced per planned graph for this model (the planner's inductor figure,
which data.auto_buckets.compile_seconds overrides) and its steps at inductor's rate; eager compiles nothing and
steps at eager's rate. A short job pays native's compile for nothing; a long one earns it back.

Both sides are priced on the plan each backend would run (its own buckets or packed rows), so the choice is the
plan's, not a rule of thumb. `--backend` (or runtime.backend) other than auto is never second-guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

from neurontrain.backends.hosts import native_device_type
from neurontrain.backends.names import auto_backend
from neurontrain.data.buckets import training_flops_per_token
from neurontrain.data.sources import PreparedData, prepare_data
from neurontrain.errors import UsageError
from neurontrain.plan.planning import RunPlan, make_plan
from neurontrain.recipe import Recipe

CANDIDATES = ("eager", "native")
# (FLOP/s, seconds of overhead a micro-step) of a training step on one CUDA GPU, per backend. Fitted to the H100
# reference run (docs/measured.md): BERT-base, bf16, eager trained about 26,500 token slots a second, inductor's
# compiled graph about 58,000; each recipe can override neither (they only price the choice of backend).
CUDA_STEP_RATES = {"eager": (1.4e13, 0.01), "native": (3.0e13, 0.01)}


@dataclass(frozen=True)
class PricedJob:
    backend: str
    graphs: int  # graphs compiled (native: its planned TorchDynamo graphs; eager: none)
    compile_seconds: float
    steps: int  # micro-steps priced
    step_seconds: float  # all of them
    packed: bool

    @property
    def seconds(self) -> float:
        return self.compile_seconds + self.step_seconds

    def describe(self) -> str:
        compiled = f"{self.compile_seconds:.0f} s compiling {self.graphs} graph(s) + " if self.graphs else ""
        shape = "packed rows" if self.packed else "buckets"
        steps = f"{self.step_seconds:.0f} s for {self.steps} steps ({shape})"
        return f"{self.backend} {compiled}{steps} = {self.seconds:.0f} s"


@dataclass(frozen=True)
class BackendChoice:
    backend: str
    reason: str
    priced: tuple[PricedJob, ...] = ()


def price_job(plan: RunPlan, compile_seconds_per_graph: float) -> PricedJob:
    """The seconds `plan`'s training costs on a CUDA GPU: its planned micro-steps at the backend's rate (tokens a
    step: the batch's rows x its length), and on native a compile per planned graph."""
    dims = plan.dims
    flops, overhead = CUDA_STEP_RATES[plan.backend]
    dense, attention = training_flops_per_token(dims.n_params, dims.n_layers, dims.hidden)
    rows = plan.recipe.data.batch_size  # one worker's rows: workers step in parallel
    lengths = plan.planned_lengths()
    steps = sum(overhead + rows * n * (dense + attention * n) / flops for n in lengths)
    graphs = len(plan.expected_graphs()) if plan.backend == "native" else 0
    return PricedJob(
        plan.backend, graphs, graphs * compile_seconds_per_graph, len(lengths), steps, plan.packing is not None
    )


def choose_priced(priced: list[PricedJob]) -> BackendChoice:
    """The cheaper of the priced jobs, with the figures that chose it (pure)."""
    best = min(priced, key=lambda job: job.seconds)
    figures = "; ".join(job.describe() for job in priced)
    return BackendChoice(best.backend, f"backend auto -> {best.backend}: the whole job priced on this GPU: {figures}")


def cuda_auto_host(requested: str) -> bool:
    """Whether `requested` is auto and this host resolves auto to native on CUDA (no torch-xla, no TorchNeuron)."""
    return requested == "auto" and auto_backend()[0] == "native" and native_device_type() == "cuda"


def choose_job_backend(recipe: Recipe, world: int = 1, data: PreparedData | None = None) -> BackendChoice:
    """Eager or native for this job on a CUDA host, by the priced time of the whole job. A backend that refuses
    the job (native: tensor parallel, ZeRO-1) is not a candidate."""
    data = data or prepare_data(recipe)
    priced, refused = [], []
    for backend in CANDIDATES:
        try:
            plan = make_plan(recipe, backend, data=data, world=world)
        except UsageError as exc:
            refused.append(f"{backend} refuses the job ({exc})")
            continue
        priced.append(price_job(plan, plan.compile_seconds_per_graph))
    if not priced:
        raise UsageError(f"backend auto: {'; '.join(refused)}")
    choice = choose_priced(priced)
    reason = "; ".join([choice.reason, *refused])
    return BackendChoice(choice.backend, reason, tuple(priced))
