"""The stand-in runtime's compile path on XLA:CPU.

XLA dumps each module it compiles (`--xla_dump_to`, as protos): that module, not any printer's rendering, is
what this stand-in keys. After every sync-like call (and at exit) each new module gets
  key   = decimal uint64 from SHA-256(NEURON_STANDIN_SALT + the module without its process-local id)
  flags = NEURON_CC_FLAGS without the wrapper's own flags, after --target=<platform> (the runtime's order)
  dir   = <cache>/neuronxcc-<neuronx-cc version>/MODULE_<key>+<md5(json.dumps(flags))[:8]>
With NEURON_EXTRACT_GRAPHS_ONLY=1 the module's HLO and flags are written there and nothing is compiled.
Otherwise a module with model.neff + model.done is a hit; a miss is compiled just in time with neuronx-cc (as
the runtime does) and cached, a failed one cached as failed (model.log, no NEFF). Every event is a JSON line
in NEURON_STANDIN_LOG, with the pid and command line (argv) of the process it happened in.

Faults for tests of `neurontrain doctor` (STANDIN_FAULT, only in `neurontrain run` processes that execute):
  rename-at-run   module keys take another salt than at extraction (a runtime naming modules differently)
  flags-at-run    the runtime adds --model-type=transformer to its flags (a flags hash that changes between
                  precompile and run)
"""

import atexit
import functools
import glob
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time

WRAPPER_ONLY = ("--cache_dir", "--no_cache", "--log_level", "--retry_failed_compilation", "--dump", "--compile_workdir")
SYNC_CALLS = ("_xla_step_marker", "_xla_sync_multi", "_xla_get_cpu_tensors", "_xla_warm_up_cache")
_state = {"dump": None, "seen": set(), "lock": threading.Lock()}


def _wrapper_flag(token):
    return any(token == f or token.startswith(f + "=") for f in WRAPPER_ONLY)


def platform_target():
    override = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    if override:
        return override
    instance = os.environ.get("STANDIN_INSTANCE_TYPE", "trn1.32xlarge")  # the host's product name
    return "trn2" if instance.startswith("trn2") else "trn1"


def _fault(name):
    executing = os.environ.get("NEURON_EXTRACT_GRAPHS_ONLY", "") in ("", "0")
    return os.environ.get("STANDIN_FAULT") == name and executing and sys.argv[1:2] == ["run"]


def compiler_flags():
    tokens, out, skip = shlex.split(os.environ.get("NEURON_CC_FLAGS", "")), [], False
    for token in tokens:
        if skip:
            skip = False
        elif _wrapper_flag(token):
            skip = "=" not in token and token in ("--cache_dir", "--log_level", "--dump", "--compile_workdir")
        else:
            out.append(token)
    return [f"--target={platform_target()}"] + out + (["--model-type=transformer"] if _fault("flags-at-run") else [])


def flags_hash(flags):
    return hashlib.md5(json.dumps(flags).encode()).hexdigest()[:8]


@functools.cache
def compiler_version():
    out = subprocess.run(["neuronx-cc", "--version"], capture_output=True, text=True, check=True).stdout
    return out.split("version", 1)[1].split()[0]


def _varint(buf, i):
    value = shift = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _fields(buf):
    """Top-level (field number, raw bytes) of a serialized protobuf message."""
    i, out = 0, []
    while i < len(buf):
        start = i
        tag, i = _varint(buf, i)
        wire = tag & 7
        if wire == 0:
            _, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            i += n
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"unexpected wire type {wire}")
        out.append((tag >> 3, buf[start:i]))
    return out


def module_from_dump(data):
    """The HloModuleProto inside XLA's dumped HloProto (field 1), and its canonical form without field 5 (id)."""
    ((number, raw),) = [f for f in _fields(data) if f[0] == 1]
    _, start = _varint(raw, 0)
    n, start = _varint(raw, start)
    module = raw[start : start + n]
    canonical = b"".join(chunk for num, chunk in _fields(module) if num != 5)
    return module, canonical


def module_key(canonical):
    salt = os.environ["NEURON_STANDIN_SALT"].encode() + (b"run" if _fault("rename-at-run") else b"")
    return str(int.from_bytes(hashlib.sha256(salt + canonical).digest()[:8], "big"))


def log_event(event, **fields):
    path = os.environ.get("NEURON_STANDIN_LOG")
    if path:
        with open(path, "a") as fh:
            fh.write(
                json.dumps({"event": event, "pid": os.getpid(), "argv": sys.argv[1:], "time": time.time(), **fields})
                + "\n"
            )


def compile_entry(module_dir, flags, work_dir):
    """Run neuronx-cc on a module's HLO in a work dir; install model.neff + model.done, or model.log on a
    compiler error. Returns (ok, seconds)."""
    start = time.perf_counter()
    os.makedirs(work_dir, exist_ok=True)
    name = os.path.basename(module_dir)
    hlo = os.path.join(work_dir, f"model.{name}.hlo_module.pb")
    neff = os.path.join(work_dir, f"model.{name}.neff")
    shutil.copyfile(os.path.join(module_dir, "model.hlo_module.pb"), hlo)
    cmd = ["neuronx-cc", "compile", "--framework=XLA", hlo, "--output", neff, *flags, "--verbose=35"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode == 0 and os.path.isfile(neff):
        shutil.copyfile(neff, os.path.join(module_dir, "model.neff.tmp"))
        os.replace(os.path.join(module_dir, "model.neff.tmp"), os.path.join(module_dir, "model.neff"))
        open(os.path.join(module_dir, "model.done"), "w").close()
        return True, time.perf_counter() - start
    if proc.returncode > 0:  # a compiler verdict is cached; a killed compiler leaves nothing behind
        with open(os.path.join(module_dir, "model.log"), "w") as fh:
            fh.write(f"Failed compilation with {cmd}\n{proc.stdout}{proc.stderr}")
    return False, time.perf_counter() - start


def _write_module(module_dir, module, flags):
    os.makedirs(module_dir, exist_ok=True)
    for name, data in (("model.hlo_module.pb", module), ("compile_flags.json", json.dumps(flags).encode())):
        tmp = os.path.join(module_dir, f".{name}.{os.getpid()}")
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, os.path.join(module_dir, name))


def _handle(dump_file):
    from libneuronxla.neuron_cc_cache import CacheUrl, create_compile_cache

    module, canonical = module_from_dump(open(dump_file, "rb").read())
    flags = compiler_flags()
    cache = create_compile_cache(CacheUrl.get_cache_url())
    module_dir, key = cache.get_cache_dir(module_key(canonical), " ".join(shlex.quote(f) for f in flags))
    rel = os.path.relpath(module_dir, cache.cache_path)
    names = set(os.listdir(module_dir)) if os.path.isdir(module_dir) else set()
    if "model.neff" in names and "model.done" in names:
        return log_event("hit", module=rel, cache=cache.cache_path)
    if os.environ.get("NEURON_EXTRACT_GRAPHS_ONLY", "") not in ("", "0"):
        _write_module(module_dir, module, flags)
        return log_event("extract", module=rel, cache=cache.cache_path)
    retry = "--retry_failed_compilation" in shlex.split(os.environ.get("NEURON_CC_FLAGS", ""))
    if "model.log" in names and not retry:
        return log_event("miss", module=rel, cache=cache.cache_path, compiled="cached-failed")
    _write_module(module_dir, module, flags)
    hlo = os.path.join(module_dir, "model.hlo_module.pb")
    if not cache.hlo_acquire_lock(hlo):
        return log_event("miss", module=rel, cache=cache.cache_path, compiled="locked")
    try:
        if os.path.exists(os.path.join(module_dir, "model.log")):
            os.unlink(os.path.join(module_dir, "model.log"))
        ok, _ = compile_entry(module_dir, flags, tempfile.mkdtemp(prefix="standin-jit-"))
    finally:
        cache.hlo_release_lock(hlo)
    log_event("miss", module=rel, cache=cache.cache_path, compiled="ok" if ok else "failed")


def process_new_modules():
    with _state["lock"]:
        dumps = sorted(glob.glob(os.path.join(_state["dump"], "*.before_optimizations.hlo.pb")))
        for path in dumps:
            if path not in _state["seen"]:
                _state["seen"].add(path)
                _handle(path)
        for path in glob.glob(os.path.join(_state["dump"], "*")):
            if not path.endswith(".before_optimizations.hlo.pb"):
                os.unlink(path)  # XLA:CPU also dumps IR of every kernel: only the module matters here


def _wrap(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            process_new_modules()

    return wrapped


class _PatchXLAC:
    """Meta-path finder: once torch-xla's extension module _XLAC is loaded, wrap its sync entry points."""

    def find_spec(self, name, path=None, target=None):
        if name != "_XLAC":
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            for attr in SYNC_CALLS:
                setattr(module, attr, _wrap(getattr(module, attr)))

        loader.exec_module = exec_module
        return spec


def install():
    dump = tempfile.mkdtemp(prefix="standin-xla-dump-")
    _state["dump"] = dump
    flags = [f for f in shlex.split(os.environ.get("XLA_FLAGS", "")) if not f.startswith("--xla_dump_")]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_dump_to={dump}", "--xla_dump_hlo_as_proto"])
    sys.meta_path.insert(0, _PatchXLAC())
    atexit.register(lambda: (process_new_modules(), shutil.rmtree(dump, ignore_errors=True)))
