"""Learned head maps: which KV heads are retrieval heads (LycheeDecode §3.2 / App. A) and the baselines.

    hardkuma.py         HardKuma(α, β) gates: sampling, closed-form P(z=0), P(z=1), E‖z‖₀, E[z]
    gates.py            the gate families the trainer optimizes: HardKuma, HardConcrete (L0), Duo (continuous α)
    lagrangian.py       λ ≥ 0 of L_distill + λ·(E‖z‖₀ − N_target), gradient ascent, clamped at 0
    mixed_attention.py  transformers AttentionInterface function: z·A_full + (1−z)·A_sparse on decode-style targets
    data.py             passkey training samples over real text; the dense prompt KV cache + teacher logits
    trainer.py          the training loop (seeded, resumable, progress bar), map extraction
    retrieval_score.py  training-free retrieval score (Wu et al. 2024)
    duo_import.py       DuoAttention per-KV-head TSV patterns -> HeadMap
    compare.py          passkey accuracy of several maps through lychee_compile at equal retrieval-head count
    reselect.py         re-derive a map (top-N / threshold) from the scores a trained map keeps in its metadata
    plots.py            E[z] per head over steps (heatmap) and the final map
    cli.py              `lychee train-heads`

Shipped maps: shipped_map_path() / load_shipped_map() (lychee_compile/data/NAME.safetensors): "smollm2-135m" (the
package default), "qwen2.5-coder-0.5b" and "gemma3-270m" (8K-32K), each made and certified by `lychee calibrate`
(its metadata: target, measured quality with intervals, recommended budget); "smollm2-135m-hardkuma", the HardKuma
map this trainer learned (docs/quality.md compares them). shipped_map_for(model): the certified one made for this model's config.
"""


def shipped_map_path(name: str = "smollm2-135m") -> str:
    """Path of a head map shipped in the package (lychee_compile/data/NAME.safetensors); its metadata says how it
    was made."""
    from importlib import resources
    return str(resources.files("lychee_compile").joinpath("data", f"{name}.safetensors"))


def load_shipped_map(name: str = "smollm2-135m"):
    from ..head_map import HeadMap
    return HeadMap.load(shipped_map_path(name))


def certified_shipped_maps():
    """[(map, path)] of the maps in lychee_compile/data that `lychee calibrate` certified."""
    import glob
    import os

    from ..head_map import HeadMap
    found = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(shipped_map_path()), "*.safetensors"))):
        hm = HeadMap.load(path)
        if hm.metadata.get("calibration_status") == "certified":
            found.append((hm, path))
    return found


def shipped_map_for(model):
    """(map, path) of the certified shipped map made for `model` -- its metadata's config_fingerprint is that of
    model.config (head_map.config_fingerprint: the architecture's shape fields, no model names) -- or None."""
    from ..head_map import config_fingerprints
    known = config_fingerprints(model.config)
    return next(((hm, path) for hm, path in certified_shipped_maps()
                 if hm.metadata.get("config_fingerprint") in known), None)
