"""A Python module from kernel source text: Triton's JIT reads a kernel's source from its file, so generated text
is written once to a content-addressed file under the temporary directory and imported from there. The deferred
selection's kernel (deferred.py) and the standalone kernels of tests and benchmarks (standalone.py) load this way."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile

_MODULE_DIR = os.path.join(tempfile.gettempdir(), f"lychee_kernels_{os.getuid() if hasattr(os, 'getuid') else 0}")


def load_module(kind: str, text: str):
    """Python module from kernel source text, written once to a content-addressed file."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    os.makedirs(_MODULE_DIR, exist_ok=True)
    path = os.path.join(_MODULE_DIR, f"lychee_{kind}_{digest}.py")
    if not os.path.exists(path):
        tmp = path + f".{os.getpid()}.tmp"
        with open(path + f".{os.getpid()}.tmp", "w") as f:
            f.write(text)
        os.replace(tmp, path)
    modname = f"_lychee_kernels_{kind}_{digest}"
    if modname in sys.modules:
        mod = sys.modules[modname]
    else:
        spec = importlib.util.spec_from_file_location(modname, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = mod
        spec.loader.exec_module(mod)
    return mod
