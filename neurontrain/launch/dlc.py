"""AWS Neuron PyTorch training images (deep learning containers): published tags per Neuron SDK release and the
registry account of each region, plus the name checks a SageMaker request needs (region, S3 bucket). Pure data.

Source of both tables: github.com/aws/deep-learning-containers, docs/src/data/pytorch-training-neuronx/*.yml
(the tags that generate its available-images list) and docs/reference/region_availability.md (registry account
IDs by region). Update them together when a release is published; `--image URI` overrides the table.
"""

from __future__ import annotations

import difflib
import re

from neurontrain.errors import UsageError

REPOSITORY = "pytorch-training-neuronx"

# Neuron SDK release -> image tag, for torch 2.9 (the torch-xla line this package runs on).
TAGS = {
    "2.27.1": "2.9.0-neuronx-py312-sdk2.27.1-ubuntu24.04",
    "2.28.0": "2.9.0-neuronx-py312-sdk2.28.0-ubuntu24.04",
    "2.29.0": "2.9.0-neuronx-py312-sdk2.29.0-ubuntu24.04",
    "2.29.1": "2.9.0-neuronx-py312-sdk2.29.1-ubuntu24.04",
    "2.30.0": "2.9.0-neuronx-py312-sdk2.30.0-ubuntu24.04",
}
# Neuron 2.30 dropped PyTorch/XLA for training (the Neuron documentation's announcement): its image is listed,
# but a training job on it would not run this package's XLA path.
NO_XLA_TRAINING = {"2.30.0"}
DEFAULT_SDK = "2.29.1"

ACCOUNTS = {
    "us-east-1": "763104351884",
    "us-east-2": "763104351884",
    "us-west-1": "763104351884",
    "us-west-2": "763104351884",
    "af-south-1": "626614931356",
    "ap-east-1": "871362719292",
    "ap-east-2": "975050140332",
    "ap-south-1": "763104351884",
    "ap-south-2": "772153158452",
    "ap-southeast-1": "763104351884",
    "ap-southeast-2": "763104351884",
    "ap-southeast-3": "907027046896",
    "ap-southeast-4": "457447274322",
    "ap-southeast-5": "550225433462",
    "ap-southeast-6": "633930458069",
    "ap-southeast-7": "590183813437",
    "ap-northeast-1": "763104351884",
    "ap-northeast-2": "763104351884",
    "ap-northeast-3": "364406365360",
    "ca-central-1": "763104351884",
    "ca-west-1": "204538143572",
    "eu-central-1": "763104351884",
    "eu-central-2": "380420809688",
    "eu-west-1": "763104351884",
    "eu-west-2": "763104351884",
    "eu-west-3": "763104351884",
    "eu-south-1": "692866216735",
    "eu-south-2": "503227376785",
    "eu-north-1": "763104351884",
    "il-central-1": "780543022126",
    "mx-central-1": "637423239942",
    "me-south-1": "217643126080",
    "me-central-1": "914824155844",
    "sa-east-1": "763104351884",
    "cn-north-1": "727897471807",
    "cn-northwest-1": "727897471807",
}


def check_region(region: str) -> str:
    if region not in ACCOUNTS:
        close = difflib.get_close_matches(region, list(ACCOUNTS), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UsageError(f"--region {region!r} is not an AWS region with Neuron training images{hint}")
    return region


def image_uri(region: str, sdk: str) -> str:
    """The Neuron PyTorch training image for this region and Neuron SDK release."""
    check_region(region)
    if sdk not in TAGS:
        raise UsageError(
            f"--neuron-sdk {sdk!r} has no published PyTorch 2.9 training image; known: "
            f"{', '.join(TAGS)} (or pass --image URI)"
        )
    if sdk in NO_XLA_TRAINING:
        raise UsageError(
            f"Neuron {sdk} no longer supports PyTorch/XLA training; use --neuron-sdk "
            f"{DEFAULT_SDK} or earlier (or pass --image URI)"
        )
    domain = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
    return f"{ACCOUNTS[region]}.dkr.ecr.{region}.{domain}/{REPOSITORY}:{TAGS[sdk]}"


_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


def check_s3_url(url: str, flag: str) -> tuple[str, str]:
    """s3://bucket[/prefix] with a bucket name S3 accepts (3-63 lowercase letters, digits, dots and hyphens,
    starting and ending with a letter or digit, no '..', not an IP address); returns (bucket, prefix)."""
    if not url.startswith("s3://"):
        raise UsageError(f"{flag} {url!r} must be s3://bucket/prefix")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    problem = None
    if not _BUCKET.match(bucket):
        problem = "use 3-63 lowercase letters, digits, '.' and '-', starting and ending with a letter or digit"
    elif ".." in bucket or ".-" in bucket or "-." in bucket:
        problem = "no '..', '.-' or '-.'"
    elif re.fullmatch(r"\d+\.\d+\.\d+\.\d+", bucket):
        problem = "a bucket name is not an IP address"
    elif bucket.startswith(("xn--", "sthree-")) or bucket.endswith(("-s3alias", "--ol-s3")):
        problem = "the prefix xn--/sthree- and the suffix -s3alias/--ol-s3 are reserved"
    if problem:
        raise UsageError(f"{flag} {url!r}: bad S3 bucket name {bucket!r} ({problem})")
    return bucket, prefix.strip("/")
