"""`neurontrain env`: the backend, its devices, the Neuron runtime cache and package versions."""

from __future__ import annotations

import argparse
import json
import os
import sys

from neurontrain.backends import neuron_runtime_present, package_versions, select_backend
from neurontrain.commands.arguments import add_backend_argument
from neurontrain.compile.cache import default_local
from neurontrain.compile.neuron_runtime import compiler_view
from neurontrain.compile.runtime_cache import runtime_cache_location


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_backend_argument(parser, default="auto")
    parser.add_argument("--json", action="store_true", help="JSON output")


def run(args: argparse.Namespace) -> int:
    backend = select_backend(args.backend)
    location = runtime_cache_location(os.environ, str(default_local()))
    info = {
        **backend.describe(),
        # with a runtime: the flags it hands neuronx-cc (the user's NEURON_CC_FLAGS less the wrapper's own)
        **(compiler_view(backend.compiler_flags) if neuron_runtime_present() else {}),
        "python": sys.version.split()[0],
        "packages": package_versions(),
        "neuron_runtime_cache": {
            "installed": neuron_runtime_present(),
            "root": location.root,
            "decided_by": location.source,
        },
        "environment": {
            k: v for k, v in os.environ.items() if k.startswith(("NEURON_", "XLA_", "PJRT_")) or k == "AWS_ENDPOINT_URL"
        },
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k}: {v if v is not None else '-'}")
        else:
            print(f"{key}: {value}")
    return 0
