"""Numerics: the arithmetic a quality number was measured with.

    reference   the model in fp32 where it is (CPU by default), LycheeConfig.backend as the method gives it (default
                eager): every rewritten site runs the op's eager reference (ops/reference.py), the definition of
                correctness. The sparsity collector (ops/sparsity.py) reports from it.
    kernels     a bf16 cast of the same weights on CUDA, backend inductor, CUDA graphs as the default config has them
                (LycheeConfig.cuda_graphs=None: on): every rewritten site runs the generated Triton kernels, what
                users run. The kernels report no sparsity; after scoring, the compile counters must show every
                rewritten site on the kernels (check_ran), else no number is reported.

    numerics = parse_numerics("both")              # (REFERENCE, KERNELS); "reference" / "kernels": one of them
    for n in numerics: n.require()                 # NumericsUnavailable before any work (kernels without CUDA)
    base = KERNELS.base_model(model)               # bf16 copy on CUDA (REFERENCE: the fp32 model itself)
    spec = KERNELS.spec(spec)                      # the method's config with this numerics' backend / CUDA graphs
    KERNELS.check_ran(counters, label)             # KernelsNotRun unless the kernels ran every counted site

The harness (runner.run_eval) scores each numerics from its own base model and its own dense prefill of every
prompt; with more than one numerics each label carries its name (`lychee@512[kernels]`).
"""
from __future__ import annotations

import copy
import dataclasses

import torch

from ..errors import KernelsNotRun, NumericsUnavailable

CHOICES = ("reference", "kernels", "both")


@dataclasses.dataclass(frozen=True)
class Numerics:
    name: str
    dtype: torch.dtype
    device: str | None            # None: wherever the model is
    backend: str | None           # LycheeConfig.backend; None: the method's own (reference: default eager)
    cuda_graphs: bool | None      # LycheeConfig.cuda_graphs (None: the default, on for CUDA + Inductor)
    kernels: bool                 # every rewritten site must run the Triton kernels (check_ran)

    @property
    def tag(self) -> str:
        """What a label carries when several numerics run side by side: "[kernels]"."""
        return f"[{self.name}]"

    def require(self) -> None:
        """Refuse, before anything is loaded or prefilled, a numerics this machine cannot run."""
        if self.device == "cuda" and not torch.cuda.is_available():
            raise NumericsUnavailable(f"numerics {self.name!r} runs the bf16 Triton kernels on a CUDA GPU, and torch "
                                      "sees none here (torch.cuda.is_available() is False); use 'reference'")

    def base_model(self, model):
        """The uncompiled model this numerics scores from: `model` itself when it already has this dtype (and
        device), else a copy cast from the same weights (the original stays as it is)."""
        device = torch.device(self.device) if self.device is not None else model.device
        if model.dtype == self.dtype and model.device.type == device.type:
            return model
        return copy.deepcopy(model).to(device=device, dtype=self.dtype)

    def spec(self, spec):
        """A MethodSpec with this numerics' backend and CUDA graphs (dense, the uncompiled model: as it is)."""
        if spec.config is None:
            return spec
        changes = dict(cuda_graphs=self.cuda_graphs)
        if self.backend is not None:
            changes["backend"] = self.backend
        return dataclasses.replace(spec, config=dataclasses.replace(spec.config, **changes))

    def check_ran(self, counters, label: str) -> None:
        """Kernels: raise KernelsNotRun unless the compiled decode graphs put sites on the kernels and none on the
        op's reference (lowering/kernel_path.py counts both), so a reference number is never reported as a
        kernel number. Reference: nothing to check (backend='eager' runs the reference by choice)."""
        if not self.kernels:
            return
        if counters.sites_on_kernel == 0 or counters.sites_on_reference:
            raise KernelsNotRun(f"{label}: numerics 'kernels', but {counters.sites_on_kernel} rewritten sites ran "
                                f"the Triton kernels and {counters.sites_on_reference} the op's eager reference "
                                f"({'; '.join(counters.reference_reasons) or 'no reason recorded'}); refusing to "
                                "report its numbers as kernel numbers")


REFERENCE = Numerics("reference", torch.float32, None, None, False, False)
KERNELS = Numerics("kernels", torch.bfloat16, "cuda", "inductor", None, True)
NUMERICS = {n.name: n for n in (REFERENCE, KERNELS)}


def parse_numerics(choice: str) -> tuple[Numerics, ...]:
    """"reference" | "kernels" | "both" (reference first: the kernels rows are compared against it)."""
    if choice == "both":
        return (REFERENCE, KERNELS)
    if choice not in NUMERICS:
        raise ValueError(f"unknown numerics {choice!r}; choose from {', '.join(CHOICES)}")
    return (NUMERICS[choice],)


def require_all(numerics) -> None:
    for n in numerics:
        n.require()
