"""CodegenKey: our code generation as part of Inductor's FX graph cache key.

Inductor's FX graph cache keys a compiled graph on Inductor's config and the graph, not on our templates, our
lowering or the KernelOptions of the compile. So without this a cache entry written by another version of
lychee_compile (other kernel text, PDL kernels without a wait) or with other KernelOptions would be served as is.
It is a post-grad pass that changes nothing (Inductor's CustomGraphPass): its uuid(), which Inductor folds into the
key, is a digest of the lowering package's sources (Python and kernel templates) plus the options.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os

from . import compat

# What the digest covers: this package's files with these endings, in name order, subfolders included.
SOURCE_SUFFIXES = (".py", ".jinja", ".triton")
# ops/policies.py: its constants (POLICIES, RANK_DROP_BITS -> the combine's LOWB) are compiled into the kernels.
CONSTANT_SOURCES = ("../ops/policies.py",)


class CodegenKey(compat.CustomGraphPass):
    def __init__(self, options) -> None:
        self.options = options      # config.KernelOptions of the compile

    def __call__(self, graph) -> None:
        return None

    def uuid(self) -> str:
        return codegen_digest() + repr(sorted(dataclasses.asdict(self.options).items()))


@functools.lru_cache(maxsize=1)
def codegen_digest() -> str:
    """sha256 of the lowering package's sources (SOURCE_SUFFIXES) and of the modules outside it whose constants the
    kernels are generated from (CONSTANT_SOURCES), by path relative to the package, in order."""
    folder = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    found = [os.path.normpath(os.path.join(folder, p)) for p in CONSTANT_SOURCES]
    for root, _dirs, files in os.walk(folder):
        found += [os.path.join(root, n) for n in files if n.endswith(SOURCE_SUFFIXES)]
    for path in sorted(found, key=lambda p: os.path.relpath(p, folder)):
        with open(path, "rb") as f:
            h.update(os.path.relpath(path, folder).encode() + b"\0" + f.read())
    return h.hexdigest()
