"""load_data: one entry point from a DataConfig to checked train/val tokens.

Every check that can fail runs here, before a model is built, so bad data stops a run within a
second with a DataError naming the file (or setting) and the problem.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .datatypes import FORMATS, LOSS_ON, SOURCES, DataConfig, DataError, TokenData
from .corpus import list_stdlib_files, list_text_files, load_corpus, stdlib_root
from .memory import available_bytes, check_corpus_fits
from .multihop import MultiHopProbe
from .shards import load_nanogpt, load_shard_folder


def _max_token(t: torch.Tensor) -> int:
    # torch implements no reductions for uint16; numpy does (and reads a memory map in place).
    return int(t.numpy().max()) if t.dtype == torch.uint16 else int(t.max())


def _check_settings(cfg: DataConfig, seq_len: int) -> None:
    if cfg.name not in SOURCES:
        raise DataError(f"data.name={cfg.name!r} is not a known source; allowed: {', '.join(SOURCES)}")
    if not 0.0 < cfg.val_fraction < 1.0:
        raise DataError(f"data.val_fraction={cfg.val_fraction}: must lie strictly between 0 and 1")
    if cfg.max_bytes is not None and cfg.max_bytes < 1:
        raise DataError(f"data.max_bytes={cfg.max_bytes}: must be positive (or null for no cap)")
    if not 1 <= cfg.vocab_size <= 2**16:
        raise DataError(f"data.vocab_size={cfg.vocab_size}: must lie in [1, 65536] (tokens are stored as uint16)")
    if seq_len < 1:
        raise DataError(f"seq_len={seq_len}: must be positive")
    if cfg.loss_on not in LOSS_ON:
        raise DataError(f"data.loss_on={cfg.loss_on!r}: allowed: {', '.join(LOSS_ON)}")
    if cfg.format not in FORMATS:
        raise DataError(f"data.format={cfg.format!r}: allowed: {', '.join(FORMATS)}")
    if cfg.loss_on == "answers" and cfg.name != "multihop":
        raise DataError(f"data.loss_on=answers needs data.name=multihop (the answers are its queries' "
                        f"digits), got data.name={cfg.name}")
    if cfg.name in ("text", "shards", "nanogpt") and not cfg.path:
        raise DataError(f"data.path is required for data.name={cfg.name}")


def _path(cfg: DataConfig) -> Path:
    path = Path(cfg.path).expanduser()
    if not path.exists():
        raise DataError(f"{path}: no such file or folder (data.path for data.name={cfg.name})")
    return path


def _check_tokens(entry: dict, cfg: DataConfig, seq_len: int, where: str) -> None:
    for split in ("train", "val"):
        t, spans = entry[split], entry["spans"][split]
        if t.numel() < seq_len + 1:
            files = ", ".join(s[0] for s in spans[:3]) + (", …" if len(spans) > 3 else "")
            raise DataError(
                f"{where}: sequence longer than the data, the {split} split has {t.numel()} tokens "
                f"({len(spans)} files{': ' + files if files else ''}) but seq_len+1 = {seq_len + 1} are "
                "needed; lower the sequence length or raise data.max_bytes / data.val_fraction"
            )
        if t.numel() and _max_token(t) >= cfg.vocab_size:
            for name, start, end in spans:
                top = _max_token(t[start:end])
                if top >= cfg.vocab_size:
                    raise DataError(
                        f"{name}: token {top} >= data.vocab_size={cfg.vocab_size} ({split} split); "
                        "set data.vocab_size to the tokenizer's vocabulary (256 bytes, 50257 GPT-2)"
                    )


def load_data(cfg: DataConfig, seq_len: int) -> TokenData:
    """Load, check and fingerprint the configured data. Raises DataError on anything wrong."""
    _check_settings(cfg, seq_len)
    if cfg.name == "multihop":
        probe = MultiHopProbe.from_config(cfg)
        if cfg.aligned and seq_len != probe.example_len:
            raise DataError(
                f"multihop: data.aligned=true trains one example a row, so train.seq_len must be the "
                f"example length, {probe.example_len} tokens here (data.n_vars={cfg.n_vars}, "
                f"data.queries={cfg.queries}, data.format={cfg.format}); got seq_len={seq_len}"
            )
        if seq_len < probe.example_len:
            raise DataError(
                f"multihop: seq_len={seq_len} is shorter than one example ({probe.example_len} tokens "
                f"for data.n_vars={cfg.n_vars}); raise the sequence length or lower data.n_vars"
            )
        if cfg.vocab_size < 256:
            raise DataError(f"multihop: data.vocab_size={cfg.vocab_size}, but the probe is byte-level (256)")
        train, val = probe.tokens("train"), probe.tokens("val")
        return TokenData(train, val, cfg.vocab_size, probe.fingerprint(train, val))

    if cfg.name in ("stdlib", "text"):
        root = _path(cfg) if cfg.path or cfg.name == "text" else stdlib_root()
        files = list_text_files(root) if cfg.name == "text" else list_stdlib_files(root)
        # before a byte is read: a corpus larger than memory went to the OOM killer, without a line
        check_corpus_fits(files, cfg.max_bytes, cfg.name == "text", available_bytes())
        entry = load_corpus(cfg.name, root, files, cfg.val_fraction, cfg.max_bytes, cfg.name == "text")
    elif cfg.name == "shards":
        root = _path(cfg)
        entry = load_shard_folder(root, cfg.val_fraction, cfg.max_bytes)
        needed = entry["fingerprint"].get("tokenizer_vocab_size")
        if isinstance(needed, int) and needed > cfg.vocab_size:
            raise DataError(
                f"{root / 'meta.json'}: shards made with tokenizer {entry['fingerprint'].get('tokenizer')!r} "
                f"of vocabulary {needed}, but data.vocab_size={cfg.vocab_size}; set data.vocab_size={needed}"
            )
    else:  # nanogpt
        root = _path(cfg)
        entry = load_nanogpt(root, cfg.val_fraction, cfg.max_bytes)
    _check_tokens(entry, cfg, seq_len, str(root))
    fingerprint = dict(entry["fingerprint"], vocab_size=cfg.vocab_size)
    return TokenData(entry["train"], entry["val"], cfg.vocab_size, fingerprint)
