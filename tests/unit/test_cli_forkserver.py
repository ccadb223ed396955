"""Which environments the tests' CLI fork server may serve (pure: no server started)."""

from cli_forkserver import can_fork

SERVER = {"PATH": "/usr/bin", "PYTHONPATH": "/repo", "XLA_FLAGS": "--xla_backend_optimization_level=1", "HOME": "/r"}


def test_run_time_variables_may_differ():
    env = {**SERVER, "NEURONTRAIN_CACHE_DIR": "/c", "AWS_ENDPOINT_URL": "http://127.0.0.1:1", "PATH": "/standin:/b"}
    env.update(PYTHONUNBUFFERED="1", MASTER_PORT="29500", NEURON_CC_FLAGS="-O1", PYTEST_CURRENT_TEST="t.py::x (call)")
    assert can_fork(SERVER, env)


def test_what_imports_read_must_be_the_servers():
    assert not can_fork(SERVER, {**SERVER, "PYTHONPATH": "/standin:/repo"})
    assert not can_fork(SERVER, {**SERVER, "XLA_FLAGS": "--xla_dump_to=/tmp/x"})
    assert not can_fork(SERVER, {**SERVER, "OMP_NUM_THREADS": "4"})
    assert not can_fork(SERVER, {**SERVER, "HF_HUB_OFFLINE": "1", "NT_TEST_MARKER": "x"})
    assert not can_fork(SERVER, {k: v for k, v in SERVER.items() if k != "HOME"})  # removed counts as changed
