"""compile_graph: Inductor on one of our rewritten Dynamo graphs, with our configuration and inside our scopes.

Called inside Dynamo's backend call (backend.py), so Dynamo's record of static inputs (parameters, the static cache,
our state buffers marked static) reaches the cudagraph wrapper. Every choice comes from the LycheeConfig of the
model (KernelOptions for the code-generation ones); Inductor's config is changed through compile_fx's
config_patches only (Inductor restores it), its class attributes only inside inductor_changes' scopes, which hold
while Inductor compiles this graph and while the compiled graph runs.

The Inductor config patches (inductor_patches), and why each, all measured side by side (docs/design-notes.md):
  * triton.cudagraphs = LycheeConfig.cuda_graphs (cudagraph trees, as mode="reduce-overhead" does).
  * combo_kernels (CUDA; KernelOptions.combo_kernels): a decode step is ~8 tiny independent pointwise / norm kernels
    per layer (rotary, the K and V cache writes, ...), each a launch and a latency; combined into fewer launches
    they saved 0.19-0.21 ms of a 12.4 ms step (Llama-3-8B shapes, 128K, H100). With them, our two launch groups
    (combo_groups.py).
  * triton.enable_pdl (CUDA, compute capability 9+; KernelOptions.pdl): programmatic dependent launch for
    Inductor's own Triton kernels: a kernel may be launched while the one before it drains. -0.06 to -0.10 ms of a
    7.6 ms hybrid step (128K b1, H100) and -0.114 ms at 128K b4 on the H200. inductor_changes says why it is safe;
    our templates launch with PDL too (pdl_templates).
  * coordinate_descent_tuning (CUDA; LycheeConfig.tune_kernels): Inductor's own decomposition then turns a one-row
    matrix product (batch-1 decode: every linear) into a multiply-reduce that it generates in Triton, fuses with its
    neighbours (the RMSNorm scale into q/k/v and gate/up, SiLU * up into down_proj, the residual add) and tunes by
    timing: hybrid 12.5%/4096 7.60 -> 7.16 ms, dense mode 12.14 -> 11.69 ms (128K, H100); the first compile of a
    32-layer step takes 20-30 s longer (Inductor caches what it found). A tuned reduction may sum in a different
    order from one compile to the next: values agree to rounding, not bit for bit. What is tuned and how variants
    are timed: inductor_changes._tune / _bench.
  * post_grad_custom_post_pass = CodegenKey (codegen_key.py), where the user set no post-grad pass of their own.
"""
from __future__ import annotations

import torch

from . import compat, inductor_changes
from .codegen_key import CodegenKey


def compile_graph(gm, example_inputs, config, decode: bool):
    """The compiled graph (a callable) of `gm` for a model with LycheeConfig `config`; decode: a rewritten decode
    step (its cuBLAS products run without a workspace unless config.decode_blas_workspace)."""
    on_cuda = any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in example_inputs)
    patches = inductor_patches(on_cuda, config)
    scope = graph_scope(config, on_cuda, decode)
    with inductor_changes.compiling(scope):
        compiled = compat.compile_fx(gm, example_inputs, config_patches=patches)

    def run_ours(*args):
        with inductor_changes.running(scope):
            return compiled(*args)
    return run_ours


def graph_scope(config, on_cuda: bool, decode: bool) -> inductor_changes.Scope:
    """The scope our Inductor changes act in for one graph: its KernelOptions, its CUDA graphs, and whether its
    cuBLAS products run without a workspace (a CUDA decode step, unless config.decode_blas_workspace: blas.py)."""
    return inductor_changes.Scope(options=config.kernels, cuda_graphs=bool(config.cuda_graphs),
                                  no_blas_workspace=on_cuda and decode and not config.decode_blas_workspace)


def inductor_patches(on_cuda: bool, config) -> dict:
    """The Inductor config patches for a graph of a model with LycheeConfig `config` (the module docstring says
    why each)."""
    options = config.kernels
    patches = {"triton.cudagraphs": bool(config.cuda_graphs)}
    if on_cuda and options.combo_kernels:
        patches["combo_kernels"] = True
    if on_cuda and config.tune_kernels:
        patches["coordinate_descent_tuning"] = True
    if on_cuda and options.pdl and compat.has_inductor_pdl():
        patches["triton.enable_pdl"] = True
    if compat.inductor_config.post_grad_custom_post_pass is None:
        patches["post_grad_custom_post_pass"] = CodegenKey(options)
    return patches


def pdl_templates(device) -> bool:
    """Launch our two templates with programmatic dependent launch: where Inductor generates PDL kernels for this
    compile (config.triton.enable_pdl, set by inductor_patches) on a CUDA device of compute capability 9+, unless
    KernelOptions.pdl_templates is off. Inductor never gives a template PDL (TritonKernel._enable_pdl_codegen); ours
    make it safe themselves: each program waits (griddepcontrol.wait) before its first memory access, so it never
    overlaps what came before, and the split releases the combine only once its own work is done; the chain
    argument of inductor_changes holds unchanged (a template waits before it completes). What it buys: each launch's
    latency overlaps the kernel before it. The combine does not release its dependents early: a kernel after it
    checks its early loads against the template's write set, which holds only the template's output, not the
    inputs it mutates (IDXO, KEYS, CNT, MASSO; TemplateBuffer.extract_read_writes, 2.11 and 2.13), so it could
    read those before they are written."""
    if not getattr(compat.inductor_config.triton, "enable_pdl", False) or torch.version.hip:
        return False
    scope = inductor_changes.active()
    if scope is not None and not scope.options.pdl_templates:
        return False
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def sparse_tile() -> dict:
    """The split launch's gathered-tile parameters of the compile being lowered (KernelOptions.sparse_tile), as
    kernel_params keywords; {} for the template's defaults."""
    scope = inductor_changes.active()
    tile = scope.options.sparse_tile if scope is not None else None
    if tile is None:
        return {}
    bn, stages, cost = tile
    return dict(sparse_bn=bn, sparse_stages=stages, sparse_cost=cost)
