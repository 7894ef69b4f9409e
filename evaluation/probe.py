"""Multi-hop probe accuracy per hop count (the paper's multi-step reasoning claim, in miniature).

A run trained on `data.name=multihop` is scored on held-out prompts of its own settings; any other
run gets the probe defaults and answers zero-shot, a number meaningful only between runs.
"""
from __future__ import annotations

from typing import Optional


def probe_metrics(model, data_cfg, max_per_hop: Optional[int] = None, batch_size: int = 256) -> dict[str, float]:
    """{"acc_hop1": …, "acc_hop2": …, …, "acc": mean over hop counts}."""
    from harness.data import DataConfig, MultiHopProbe

    cfg = data_cfg if data_cfg.name == "multihop" else DataConfig(name="multihop")
    probe = MultiHopProbe.from_config(cfg)
    need = 1 + probe.prompt_len  # the "\n" before the prompt; the digit is read at its last position
    if model.config.max_seq_len < need:
        raise ValueError(f"the probe needs {need} positions, the model's max_seq_len is {model.config.max_seq_len}")
    device = next(model.parameters()).device
    per_hop = probe.accuracy(model, device, max_per_hop=max_per_hop, batch_size=batch_size)
    out = {f"acc_hop{k}": float(v) for k, v in sorted(per_hop.items())}
    out["acc"] = sum(per_hop.values()) / len(per_hop)
    return out
