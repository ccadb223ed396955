"""MFU: the device peaks by name and family, the planner's FLOPs of the tokens trained, the figure in summary.json,
metrics.jsonl, the report page and `compare` (null on a CPU, with the reason)."""

from __future__ import annotations

import json

import pytest

from neurontrain.backends.base import Backend
from neurontrain.data.buckets import training_flops_per_token
from neurontrain.loop.metrics import MetricsWriter, StepLog
from neurontrain.loop.mfu import FlopCount, Utilisation, cpu_peak, cuda_peak, mfu_of, neuron_peak
from neurontrain.loop.run_facts import device_peak
from neurontrain.report.page import _cell


@pytest.mark.parametrize(
    ("family", "cores", "tflops"),
    [("trn1", None, 95.0), ("trn1", 1, 95.0), ("trn2", None, 166.75), ("trn2", 1, 83.375), ("trn3", None, 167.75)],
)
def test_a_neuron_worker_peaks_at_its_physical_cores_bf16_figure(family, cores, tflops):
    peak = neuron_peak(family, cores)
    assert peak.flops == pytest.approx(tflops * 1e12)
    assert peak.reason is None


def test_an_unknown_neuron_family_has_no_peak_and_says_why():
    peak = neuron_peak(None)
    assert peak.flops is None and "trn1, trn2, trn3" in peak.reason


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.4),
        ("NVIDIA GH200 480GB", 989.4),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA B200", 2250.0),
    ],
)
def test_cuda_cards_are_known_by_the_words_of_their_name(name, tflops):
    assert cuda_peak(name).flops == pytest.approx(tflops * 1e12)


@pytest.mark.parametrize("name", ["NVIDIA L40", "Tesla T4", "NVIDIA GeForce RTX 4090", None])
def test_a_card_without_a_known_peak_is_not_guessed(name):
    peak = cuda_peak(name)
    assert peak.flops is None and peak.reason


def test_flops_count_each_bucket_at_its_own_length_and_mfu_divides_by_all_devices():
    dense, attention = training_flops_per_token(1_000_000, 4, 256)
    count = FlopCount.of_model(1_000_000, 4, 256)
    assert (count.dense, count.attention) == (dense, attention) == (6e6, 12 * 4 * 256)
    flops = count.of_tokens({128: 1000, 512: 10})
    assert flops == 1000 * (6e6 + 12 * 4 * 256 * 128) + 10 * (6e6 + 12 * 4 * 256 * 512)
    peak = neuron_peak("trn1")
    use = Utilisation(peak, devices=32)
    assert use.mfu(flops, 2.0) == pytest.approx(flops / 2.0 / (95e12 * 32))
    basis = use.describe(flops)
    assert mfu_of(basis, 2.0) == pytest.approx(use.mfu(flops, 2.0))
    assert json.loads(json.dumps(basis)) == basis  # summary.json holds it as it is


def test_on_cpu_mfu_is_null_with_the_reason():
    use = Utilisation(cpu_peak(), devices=2)
    basis = use.describe(1e12)
    assert use.mfu(1e12, 1.0) is None and mfu_of(basis, 1.0) is None
    assert basis["reason"].startswith("CPU: n/a")
    assert mfu_of(None, 1.0) is None


def test_the_backend_names_the_device_it_runs_on(monkeypatch):
    assert device_peak(Backend("eager", "gloo", False), None).flops is None  # the host's CPU here
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    neuron = Backend("neuron", "xla", True)
    neuron.is_xla = True  # the instance only: an XLA backend's device is not touched to read its kind
    assert device_peak(neuron, None).flops == pytest.approx(83.375e12)
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE")
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG")
    assert device_peak(neuron, "trn1.32xlarge").flops in (95e12, None)  # the host's product name comes first


def _log(tmp_path, utilisation):
    writer = MetricsWriter(tmp_path, None, write=False)
    return StepLog(
        writer,
        total_steps=2,
        first_step=0,
        compilations=lambda: 0,
        global_counts=lambda real, slots: (2 * real, 2 * slots),  # two workers of the same counts
        utilisation=utilisation,
    )


def test_a_logged_step_gives_the_mfu_of_its_interval(tmp_path):
    count = FlopCount(dense=1e9, attention=1e6)
    peak = neuron_peak("trn1")
    log = _log(tmp_path, (count, Utilisation(peak, devices=2)))
    log.count(100, 128, 128)
    log.count(50, 64, 64)
    log.train(1, 1e-3, 2.0)
    record = log.records[-1]
    flops = 2 * (100 * count.per_token(128) + 50 * count.per_token(64))
    seconds = (2 * 150) / record["tokens_per_second"]  # the interval the record measured
    assert record["mfu"] == pytest.approx(flops / seconds / (2 * 95e12), rel=1e-6)
    cpu = _log(tmp_path, (count, Utilisation(cpu_peak(), devices=1)))
    cpu.count(10, 10, 10)
    cpu.train(1, 1e-3, 2.0)
    assert "mfu" in cpu.records[-1] and cpu.records[-1]["mfu"] is None
    plain = _log(tmp_path, None)
    plain.count(10, 10, 10)
    plain.train(1, 1e-3, 2.0)
    assert "mfu" not in plain.records[-1]


def test_the_report_shows_mfu_or_why_not():
    assert _cell({"mfu": 0.4123}, "mfu") == "41.23%"
    assert _cell({"mfu": None, "mfu_basis": {"reason": "CPU: n/a (x)"}}, "mfu") == "n/a (CPU: n/a (x))"
    assert _cell({}, "mfu") == "-"  # a summary from before MFU


def test_compare_shows_mfu_side_by_side():
    from neurontrain.commands.compare import render
    from neurontrain.report.comparison import compare

    base = {
        "recipe": "r",
        "backend": "neuron",
        "steps": 2,
        "effective_batch": 8,
        "samples_trained": 16,
        "world_size": 1,
        "tokens_per_second": 1000.0,
        "final_loss": 2.0,
        "model_fingerprint": "m",
        "data_fingerprint": "d",
        "compilations": 1,
        "compile_seconds": 1.0,
        "padding_fraction": 0.0,
    }
    records = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}]
    result = compare(({**base, "mfu": 0.3512}, records), ({**base, "mfu": None}, records), metric="train_loss")
    (row,) = [line for line in render(result, "a", "b").splitlines() if line.startswith("MFU")]
    assert row.split()[1:] == ["35.12%", "n/a"]
