"""Assertions shared by the checkpoint layout tests: a round trip through NxD shards and back, compared with
the model's own save_pretrained, and optimizer moments compared tensor by tensor."""

import json

import torch

from neurontrain.checkpoint.migrate import MigrateOptions, migrate, open_model_checkpoint
from neurontrain.checkpoint.verify import compare, logits_diff


def round_trip(tmp_path, src, reference, name, config=None, with_optimizer=False):
    """SRC --to neuron --tp 2, and back; the result equals REFERENCE tensor by tensor and in logits, and so
    does SRC read directly. Returns (migrate's result, the directory migrated back)."""
    nxd, back = tmp_path / f"{name}-nxd", tmp_path / f"{name}-back"
    result = migrate(src, nxd, MigrateOptions(to="neuron", tp=2, config=config, with_optimizer=with_optimizer))
    migrate(nxd, back, MigrateOptions(to="gpu", with_optimizer=with_optimizer))
    ref = open_model_checkpoint(reference)
    for other in (open_model_checkpoint(back), open_model_checkpoint(src, config), open_model_checkpoint(nxd)):
        outcome = compare(ref, other)
        assert outcome["equal"], (name, other.description, outcome["differing"][:2], outcome["missing_in_b"][:3])
    model_config = json.loads((reference / "config.json").read_text())
    assert logits_diff(ref, open_model_checkpoint(back), model_config) <= 1e-5
    return result, back


def assert_moments(back, expected):
    """optimizer.pt written by migrate --to gpu --with-optimizer holds `expected` ({name: {moment: tensor}})."""
    restored = torch.load(back / "optimizer.pt", weights_only=True)
    group = restored["param_groups"][0]
    by_name = dict(zip(group["param_names"], group["params"]))
    assert set(by_name) == set(expected), set(by_name) ^ set(expected)
    for name, moments in expected.items():
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(moments[moment], restored["state"][by_name[name]][moment]), (name, moment)
    # AdamW adds to each parameter's tensor step in place: two parameters sharing one would count twice
    steps = [s["step"] for s in restored["state"].values() if isinstance(s.get("step"), torch.Tensor)]
    assert len({t.untyped_storage().data_ptr() for t in steps}) == len(steps)


def moments_by_name(model, optimizer):
    """An id-keyed torch optimizer's moments under the model's parameter names."""
    return {name: dict(optimizer.state[p]) for name, p in model.named_parameters() if p in optimizer.state}
