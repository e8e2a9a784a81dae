"""What benchmarks/gpu_bench.py reports from its sides' results: the ratios of each megacli side
over the other sides, each FP8 variant beside its bf16 counterpart (speed and the loss after the
same steps, against the tolerance docs/gpu.md derives from CPU emulation), and the printed table."""

from __future__ import annotations


def ratios(sides: dict, baselines, fp8_bases: dict) -> dict:
    """tokens/s of each megacli side over each baseline side's (raw Megatron-Core, PyTorch), and of
    each FP8 variant over its bf16 counterpart (``fp8_bases``: FP8 variant -> bf16 variant)."""
    ran = {name: r for name, r in sides.items() if "error" not in r}
    out = {f"{name}_over_{other}": ran[name]["tokens_per_s"] / ran[other]["tokens_per_s"]
           for name in ran if name.startswith("megacli") for other in baselines if other in ran}
    for name, base in _fp8_pairs(ran, fp8_bases):
        out[f"{name}_over_{base}"] = ran[name]["tokens_per_s"] / ran[base]["tokens_per_s"]
    return out


def fp8_losses(sides: dict, fp8_bases: dict, tolerance: float) -> dict:
    """Each FP8 side's loss after the benchmark's steps beside its bf16 counterpart's, the relative
    gap and whether it is within ``tolerance``."""
    ran = {name: r for name, r in sides.items() if "error" not in r}
    out = {}
    for name, base in _fp8_pairs(ran, fp8_bases):
        fp8_loss, bf16_loss = ran[name]["final_loss"], ran[base]["final_loss"]
        gap = abs(fp8_loss - bf16_loss) / abs(bf16_loss)
        out[name] = {"bf16_side": base, "final_loss": fp8_loss, "bf16_final_loss": bf16_loss, "relative_gap": gap,
                     "tolerance": tolerance, "within_tolerance": gap <= tolerance}
    return out


def _fp8_pairs(ran: dict, fp8_bases: dict) -> list[tuple[str, str]]:
    """(FP8 side, its bf16 side) for each FP8 variant that ran beside its counterpart."""
    return [(f"megacli:{fp8}", f"megacli:{bf16}") for fp8, bf16 in fp8_bases.items()
            if f"megacli:{fp8}" in ran and f"megacli:{bf16}" in ran]


def table(results: dict) -> str:
    width = max([9] + [len(side) for sides in results.values() for side in sides])
    rows = [f"{'size':>6} {'side':>{width}} {'tokens/s':>12} {'TFLOP/s':>9} {'MFU':>7} {'peak GiB':>9} {'step s':>8}"]
    for size, sides in results.items():
        for side, r in sides.items():
            if side in ("ratios", "fp8_loss"):
                continue
            if "error" in r:
                rows.append(f"{size:>6} {side:>{width}} failed: {r['error'].strip().splitlines()[-1][:200]}")
                continue
            rows.append(f"{size:>6} {side:>{width}} {r['tokens_per_s']:>12,.0f} {r['tflops']:>9.1f} {r['mfu'] * 100:>6.1f}% "
                        f"{r['peak_memory_gib']:>9.2f} {r['step_time_s']:>8.4f}")
        for name, value in sides.get("ratios", {}).items():
            rows.append(f"{size:>6} {'ratio':>{width}} {name.replace('_over_', '/')} {value:.3f} (tokens/s)")
        for name, r in sides.get("fp8_loss", {}).items():
            verdict = "within" if r["within_tolerance"] else "OUTSIDE"
            rows.append(f"{size:>6} {'loss':>{width}} {name} {r['final_loss']:.4f} vs {r['bf16_side']} "
                        f"{r['bf16_final_loss']:.4f}: gap {r['relative_gap']:.2e}, {verdict} the tolerance {r['tolerance']:.0e}")
    return "\n".join(rows)


def device_name(device: str) -> str:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    import platform

    return platform.processor() or platform.machine()
