"""A failure raised inside a dependency names the package and its version in the CLI's one line, so a user can
tell a toolkit bug from a dependency release that changed."""

import sys

import pytest
import yaml

from neurontrain.cli import main
from neurontrain.errors import dependency_frames, raised_in


def test_frames_outside_the_toolkit_and_stdlib():
    installed = {"transformers": ["transformers"], "kernels": ["kernels"], "torch": ["torch"], "json": ["x"]}
    modules = [
        "__main__",
        "neurontrain.cli",
        "my_script",
        "transformers.modeling_utils",
        "kernels.layer",
        "json.decoder",
    ]
    assert dependency_frames(modules, installed) == ("transformers", "kernels")
    assert dependency_frames(["neurontrain.cli", "json.decoder", "collections"], installed) == (None, None)
    assert dependency_frames(["neurontrain.cli", "torch.nn.modules.module"], installed) == ("torch", "torch")


def test_raised_in_names_the_distribution_and_version():
    from importlib import metadata

    with pytest.raises(yaml.YAMLError) as caught:
        yaml.safe_load("a: [")
    assert raised_in(caught.value) == f"raised in PyYAML {metadata.version('PyYAML')}"  # module yaml, package PyYAML
    try:
        raise ValueError("ours")
    except ValueError as exc:
        assert raised_in(exc) is None


def test_cli_line_names_the_package(monkeypatch, capsys):
    """An unexpected exception from inside a package, reached through a verb, ends as one line naming it."""
    import neurontrain.commands.env as env_command

    def failing(args):
        yaml.safe_load("a: [")

    monkeypatch.setattr(env_command, "run", failing)
    monkeypatch.setattr(sys, "argv", ["neurontrain"])
    assert main(["env"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("neurontrain: error: ") and "raised in PyYAML " in err[0], err
