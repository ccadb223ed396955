"""What each host's `ray start` is given (pure: no Ray started)."""

from neurontrain.launch.ray_hosts import DRAIN_TIMEOUT, ray_start_env


def test_ray_start_skips_the_sigterm_drain_unless_the_job_sets_it():
    assert ray_start_env({"PATH": "/bin"}) == {"PATH": "/bin", DRAIN_TIMEOUT: "0"}
    assert ray_start_env({DRAIN_TIMEOUT: "12"})[DRAIN_TIMEOUT] == "12"
