"""Data for the experiment harness: corpora, token shards, batches and the multi-hop probe.

    from harness.data import DataConfig, TokenData, DataError, load_data, batch_iterator, val_batches, MultiHopProbe

    data = load_data(DataConfig(), seq_len=256)          # the stdlib corpus, checked and fingerprinted
    for x, y in batch_iterator(data.train, 16, 256, seed=0, start_batch=step): ...
    held_out = val_batches(data.val, 16, 256, max_batches=20)

Sources (`DataConfig.name`): stdlib (default, no download), text, shards (llm.c), nanogpt, multihop.
See docs/DATA.md. Modules: config (types), corpus (stdlib and text files), shards (.bin formats),
cache (on-disk cache), batches, multihop, load (load_data), prepare (Hugging Face → shards CLI).
"""
from .batches import batch_iterator, val_batches
from .datatypes import SOURCES, DataConfig, DataError, TokenData
from .load import load_data
from .multihop import Example, MultiHopProbe, resolve
from .shards import read_nanogpt_bin, read_shard, write_nanogpt_bin, write_shard

__all__ = [
    "SOURCES", "DataConfig", "DataError", "TokenData", "load_data", "batch_iterator", "val_batches",
    "MultiHopProbe", "Example", "resolve", "read_shard", "write_shard", "read_nanogpt_bin",
    "write_nanogpt_bin",
]
