"""Stand-in of the runtime's parallel compile phase (`neuron_parallel_compile --command compile`, and the
library call `parallel_compile(work_dir, cache_url, num_parallel)` it wraps): every cached HLO without a NEFF,
compiled with neuronx-cc in a process pool; failed compiles cached as failed; returns the number of failures.
With NEURON_PARALLEL_COMPILE_DUMP_RESULTS set, writes neuron_parallel_compile_results_<time>.json in the
current directory."""

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from libneuronxla import _standin
from libneuronxla.neuron_cc_cache import CacheUrl, create_compile_cache


def _compile_one(args):
    hlo, cache_url, work_dir = args
    cache = create_compile_cache(CacheUrl(cache_url))
    if not cache.hlo_acquire_lock(hlo):
        return hlo, None, 0.0, 0
    try:
        module_dir = os.path.dirname(hlo)
        names = set(os.listdir(module_dir))
        if "model.neff" in names and "model.done" in names:
            return hlo, True, 0.0, 0
        flags = json.load(open(os.path.join(module_dir, "compile_flags.json")))
        retries = int(os.environ.get("NEURON_PARALLEL_COMPILE_MAX_RETRIES", "0"))
        for attempt in range(retries + 1):
            ok, seconds = _standin.compile_entry(
                module_dir, flags, os.path.join(work_dir, os.path.basename(module_dir))
            )
            if ok or os.path.exists(os.path.join(module_dir, "model.log")):
                return hlo, ok, seconds, attempt
        return hlo, False, seconds, retries
    finally:
        cache.hlo_release_lock(hlo)


def parallel_compile(work_dir, cache_url, num_parallel=None, **_):
    cache = create_compile_cache(cache_url)
    todo, _locked, _done, _failed = cache.get_hlos()
    asked = num_parallel  # what the caller passed, in the event log
    num_parallel = num_parallel or max(
        1, math.ceil(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (64 << 30))
    )
    start = time.time()
    report = {}
    with ProcessPoolExecutor(num_parallel) as pool:
        for hlo, ok, seconds, retry in pool.map(_compile_one, [(h, cache_url.url, work_dir) for h in todo]):
            if ok is not None:
                report[hlo] = {"status": ok, "retry": retry, "compile_time": seconds}
    summary = {
        "compilation_summary": {
            "true": sum(r["status"] for r in report.values()),
            "false": sum(not r["status"] for r in report.values()),
        },
        "compilation_report": report,
        "start_time": start,
        "compilation_time": time.time() - start,
    }
    print(json.dumps(summary))
    if os.environ.get("NEURON_PARALLEL_COMPILE_DUMP_RESULTS"):
        with open(f"neuron_parallel_compile_results_{int(start)}.json", "w") as fh:
            json.dump(summary, fh)
    _standin.log_event("parallel_compile", compiled=len(report), cache=cache.cache_path, num_parallel=asked)
    return summary["compilation_summary"]["false"]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="neuron_parallel_compile")
    parser.add_argument(
        "--command",
        default="collect-and-compile",
        choices=["collect-and-compile", "collect", "compile", "clean", "clear-locks", "scan"],
    )
    parser.add_argument("--num_parallel", type=int)
    parser.add_argument("--parallel_compile_workdir", default="/tmp/parallel_compile_workdir")
    parser.add_argument("user_command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    url = CacheUrl.get_cache_url()
    if args.command == "compile":
        return parallel_compile(args.parallel_compile_workdir, url, args.num_parallel)
    if args.command == "clear-locks":
        create_compile_cache(url).clear_locks()
        return 0
    if args.command == "clean":
        create_compile_cache(url).clean()
        return 0
    if args.command == "scan":
        create_compile_cache(url).get_hlos()
        return 0
    print("the stand-in runs no user command (collect)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
