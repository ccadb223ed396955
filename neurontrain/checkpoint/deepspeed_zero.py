"""DeepSpeed ZeRO 1-3 checkpoints (`global_stepN/` directories beside a `latest` file): fp32 weights rebuilt by
DeepSpeed's own zero_to_fp32, and the Adam moments read from the same partitions. DeepSpeed keeps each moment as
flat groups shaped like its fp32 master groups (one flat tensor per group per data-parallel rank: stage 1/2 a
slice of every group, stage 3 a slice of every parameter), so the moments are unflattened by the very functions
zero_to_fp32 unflattens the fp32 groups with, given the same recorded parameter shapes and paddings. Nothing
about the partitioning is computed here."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

from neurontrain.checkpoint.formats import TorchSource
from neurontrain.errors import UsageError, first_line

_MOMENTS = ("exp_avg", "exp_avg_sq")
_DS_ERRORS = (OSError, ValueError, KeyError, RuntimeError, IndexError, TypeError)


def is_deepspeed(path: Path) -> bool:
    return path.is_dir() and (
        (path / "zero_to_fp32.py").is_file()
        or any(path.glob("*_model_states.pt"))
        or any(p.is_dir() and any(p.glob("*_optim_states.pt")) for p in path.glob("global_step*"))
    )


def _zero_to_fp32():
    try:
        from deepspeed.utils import zero_to_fp32  # lazy: deepspeed is optional and slow to import
    except ImportError:
        return None
    return zero_to_fp32


def tagged_directory(path: Path) -> tuple[Path, Path]:
    """(the directory holding `latest`, the global_stepN/ directory with the partitions) of a path to either."""
    if any(path.glob("*_model_states.pt")):
        return path.parent, path
    latest = path / "latest"
    if not latest.is_file():
        raise UsageError(f"{path}: a DeepSpeed checkpoint directory without a `latest` file; point at global_stepN/")
    tagged = path / latest.read_text().strip()
    if not tagged.is_dir():
        raise UsageError(f"{latest} names {tagged.name}, which is not there")
    return path, tagged


class ZeroSource(TorchSource):
    """The fp32 weights of a ZeRO checkpoint (in memory), and its moments by parameter name when asked."""

    def __init__(self, path: Path, config: dict | None) -> None:
        """`path`: the directory with `latest` or a global_stepN/ directory; `config`: the model's config."""
        zero_to_fp32 = _zero_to_fp32()
        if zero_to_fp32 is None:
            raise UsageError(
                f"{path} is a DeepSpeed ZeRO checkpoint (global_stepN/ partitions): install deepspeed to read it, "
                "or run the zero_to_fp32.py DeepSpeed saved beside it and migrate the state dict file it writes"
            )
        directory, self.tagged = tagged_directory(path)
        try:
            with contextlib.redirect_stdout(sys.stderr):  # it prints progress; stdout is for results
                state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=self.tagged.name)
        except _DS_ERRORS as exc:
            raise UsageError(f"{path}: DeepSpeed's zero_to_fp32 cannot read it ({first_line(exc, 150)})") from None
        writer = "DeepSpeed ZeRO (fp32 rebuilt from the partitions by DeepSpeed's zero_to_fp32)"
        super().__init__([path], config, f"deepspeed {path}", "deepspeed", writer, dict(state), remappable=False)
        self.optimizer_files = sorted(self.tagged.glob("*_optim_states.pt"))

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]] | None:
        try:
            with contextlib.redirect_stdout(sys.stderr):
                return zero_moments(self.tagged)
        except _DS_ERRORS as exc:
            raise UsageError(
                f"{self.tagged}: its optimizer partitions cannot be read ({first_line(exc, 150)})"
            ) from None


def _group_states(optimizer: dict, stage: int) -> list[dict]:
    """One rank's optimizer state per flat group, in the order of its fp32 groups, without DeepSpeed's padding."""
    from deepspeed.checkpoint import constants  # lazy: deepspeed is optional and slow to import

    if stage == 3:
        inner = optimizer[constants.OPTIMIZER_STATE_DICT]
        fp32 = optimizer[constants.FP32_FLAT_GROUPS]
    else:
        inner = optimizer[constants.BASE_OPTIMIZER_STATE]
        fp32 = optimizer[constants.SINGLE_PARTITION_OF_FP32_GROUPS]
    if isinstance(inner, dict):  # a torch optimizer state dict: one flat parameter per group
        groups = [inner["state"][i] for group in inner["param_groups"] for i in group["params"]]
    else:  # elastic checkpoints: a list of group states, padding already removed
        groups = list(inner)
    if len(groups) != len(fp32):
        raise ValueError(f"{len(groups)} optimizer groups for {len(fp32)} fp32 groups")
    # the saved fp32 groups are without the alignment padding the live moments still carry
    return [
        {k: v[: f.numel()] if k in _MOMENTS else v for k, v in state.items()}
        for state, f in zip(groups, fp32, strict=True)
    ]


def zero_moments(tagged: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{parameter name: {exp_avg, exp_avg_sq, step}} from the *_optim_states.pt partitions of a global_stepN/
    directory, unflattened by zero_to_fp32's own functions."""
    from deepspeed.checkpoint import constants  # lazy: deepspeed is optional and slow to import

    zero_to_fp32 = _zero_to_fp32()
    model_states = zero_to_fp32.parse_model_states(zero_to_fp32.get_model_state_files(str(tagged)))
    files = zero_to_fp32.get_optim_files(str(tagged))
    stage, world, _, paddings = zero_to_fp32.parse_optim_states(files, str(tagged))
    # DeepSpeed pickles its own objects (loss scaler, stage enum) in these files: zero_to_fp32 loads them so too
    optimizers = [
        torch.load(f, map_location="cpu", mmap=True, weights_only=False)[constants.OPTIMIZER_STATE_DICT] for f in files
    ]
    ranks = [_group_states(o, stage) for o in optimizers]
    steps = {float(state["step"]) for groups in ranks for state in groups if "step" in state}
    if len(steps) > 1:
        raise ValueError(f"its optimizer groups hold different steps {sorted(steps)}")
    names = [name for shapes in model_states[0].param_shapes for name in shapes]
    out: dict[str, dict[str, torch.Tensor]] = {name: {} for name in names}
    for moment in _MOMENTS:
        flat = [[state[moment] for state in groups] for groups in ranks]
        if stage <= 2:
            full = zero_to_fp32._get_fp32_state_dict_from_zero2_checkpoint(world, flat, model_states, True, paddings)
        else:
            full = zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint(world, flat, model_states, True)
        full = zero_to_fp32.to_torch_tensor(full)
        for name in names:
            out[name][moment] = full[name]
    if steps:
        step = next(state["step"] for state in ranks[0] if "step" in state)
        for name in names:
            out[name]["step"] = torch.as_tensor(step).clone()
    return out
