"""Stand-in of libneuronxla.neuron_cc_cache: the cache URL precedence, the module directory layout, locks
(an flock on model.hlo_module.pb.lock, released when its process dies) and the todo/locked/done/failed scan."""

import fcntl
import os
import shlex
import shutil

DEFAULT_URL = "/var/tmp/neuron-compile-cache"
HLO = "model.hlo_module.pb"


def _cache_dir_flag():
    found, tokens = None, shlex.split(os.environ.get("NEURON_CC_FLAGS", ""))
    for i, token in enumerate(tokens):
        if token.startswith("--cache_dir="):
            found = token.split("=", 1)[1]
        elif token == "--cache_dir" and i + 1 < len(tokens):
            found = tokens[i + 1]
    return found


class CacheUrl:
    def __init__(self, url, url_type="fs"):
        self.url = url
        self.url_type = url_type

    def is_s3(self):
        return self.url.startswith("s3://")

    @classmethod
    def get_cache_url(cls, cache_dir=None):
        url = cache_dir or _cache_dir_flag() or os.environ.get("NEURON_COMPILE_CACHE_URL") or DEFAULT_URL
        return cls(url, "s3" if url.startswith("s3://") else "fs")


class CompileCache:
    def __init__(self, cache_url):
        self.cache_url = cache_url
        self.cache_path = cache_url.url
        self._locks = {}

    def version_dir(self):
        from libneuronxla import _standin

        return os.path.join(self.cache_path, f"neuronxcc-{_standin.compiler_version()}")

    def get_cache_dir(self, model_hash, compile_flags_str):
        from libneuronxla import _standin

        key = f"MODULE_{model_hash}+{_standin.flags_hash(shlex.split(compile_flags_str))}"
        return os.path.join(self.version_dir(), key), key

    def get_cache_dir_with_cache_key(self, key):
        return os.path.join(self.version_dir(), key)


class CompileCacheFs(CompileCache):
    def exists(self, path):
        return os.path.exists(path)

    def download_file(self, filename, dst_path):
        shutil.copyfile(filename, dst_path)

    def upload_file(self, cache_path, src_path):
        os.makedirs(os.path.dirname(cache_path), exist_ok=True)
        tmp = f"{cache_path}.tmp{os.getpid()}"
        shutil.copyfile(src_path, tmp)
        os.replace(tmp, cache_path)

    def hlo_acquire_lock(self, hlo):
        """Non-blocking: False when another live process holds the module's lock."""
        fd = os.open(hlo + ".lock", os.O_CREAT | os.O_WRONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._locks[hlo] = fd
        return True

    def hlo_release_lock(self, hlo):
        fd = self._locks.pop(hlo, None)
        if fd is not None:
            try:
                os.unlink(hlo + ".lock")
            except FileNotFoundError:
                pass
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _held(self, lock):
        fd = os.open(lock, os.O_WRONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def get_hlos(self, failed_neff_str=""):
        """(todo, locked, done, failed): full paths of every module's model.hlo_module.pb, sorted."""
        todo, locked, done, failed = [], [], [], []
        root = self.version_dir()
        for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
            d = os.path.join(root, name)
            hlo = os.path.join(d, HLO)
            if not name.startswith("MODULE_") or not os.path.isfile(hlo):
                continue
            names = set(os.listdir(d))
            if "model.neff" in names and "model.done" in names:
                done.append(hlo)
            elif "model.log" in names:
                failed.append(hlo)
            elif HLO + ".lock" in names and self._held(os.path.join(d, HLO + ".lock")):
                locked.append(hlo)
            else:
                todo.append(hlo)
        print(
            f"Current remaining items are {len(todo)}, locked are {len(locked)}, failed are {len(failed)}, "
            f"done are {len(done)}, total is {len(todo) + len(locked) + len(failed) + len(done)}"
        )
        return todo, locked, done, failed

    def clear_locks(self):
        for dirpath, _, files in os.walk(self.cache_path):
            for f in files:
                if f.endswith(".lock"):
                    os.unlink(os.path.join(dirpath, f))

    def clean(self):
        shutil.rmtree(self.cache_path, ignore_errors=True)


class CompileCacheS3(CompileCache):
    def __init__(self, cache_url):
        raise NotImplementedError("the stand-in runtime has no S3 cache: point the tests at a local directory")


def create_compile_cache(cache_url):
    return CompileCacheS3(cache_url) if cache_url.is_s3() else CompileCacheFs(cache_url)
