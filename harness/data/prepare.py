"""Tokenise a Hugging Face text dataset into llm.c shards that `data.name=shards` reads.

    python -m harness.data.prepare --dataset HuggingFaceFW/fineweb-edu --config sample-10BT \\
        --out data/fineweb_edu --max-tokens 200_000_000 [--tokenizer gpt2]

The dataset is streamed, so N tokens cost about N tokens of download; layout and tokenizers are
in docs/DATA.md. Anything missing (package, network, field) is one line and exit status 1.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np

from .shards import META_FILE, write_atomic, write_shard

DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB a shard, as llm.c


class PrepareError(RuntimeError):
    """A missing package, network or field: reported as one line by main()."""


def byte_tokenizer() -> tuple[Callable[[str], list[int]], int, int]:
    """(encode, eot, vocab_size) of the byte-level tokenizer."""
    # NUL bytes inside documents are dropped, so byte 0 marks only the end of text.
    return (lambda text: list(text.encode("utf-8").replace(b"\0", b"")), 0, 256)


def gpt2_tokenizer() -> tuple[Callable[[str], list[int]], int, int]:
    try:
        import tiktoken
    except ImportError:
        raise PrepareError("--tokenizer gpt2 needs the `tiktoken` package (pip install tiktoken)") from None
    try:
        enc = tiktoken.get_encoding("gpt2")
    except Exception as e:  # the BPE files are downloaded on first use
        raise PrepareError(f"tiktoken could not load the GPT-2 encoding (network?): {_one_line(e)}") from None
    return (lambda text: enc.encode_ordinary(text), enc.eot_token, enc.n_vocab)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def write_shards(
    texts: Iterable[str],
    out: Path,
    prefix: str,
    encode: Callable[[str], list[int]],
    eot: int,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    val_tokens: int = 1_000_000,
    max_tokens: Optional[int] = None,
    log: Callable[[str], None] = lambda line: None,
) -> dict:
    """Tokenise `texts` into validation then training shards under `out`; returns the summary
    that is also written to meta.json (without the dataset fields, which main() adds)."""
    out.mkdir(parents=True, exist_ok=True)
    shards: list[str] = []
    buf: list[np.ndarray] = []
    buffered = total = documents = 0
    counts = {"val": 0, "train": 0}

    def current_split() -> tuple[str, int]:
        # Validation first; its limit is val_tokens, then training shards of shard_tokens.
        if counts["val"] < val_tokens:
            return "val", val_tokens - counts["val"]
        return "train", shard_tokens

    def flush(split: str) -> None:
        nonlocal buf, buffered
        if not buffered:
            return
        path = out / f"{prefix}_{split}_{len(shards):06d}.bin"
        write_shard(path, np.concatenate(buf))
        shards.append(path.name)
        counts[split] += buffered
        log(f"wrote {path} ({buffered:,} tokens)")
        buf, buffered = [], 0

    for text in texts:
        tokens = np.asarray([eot] + list(encode(text)), dtype=np.uint16)
        if max_tokens is not None:
            tokens = tokens[: max(0, max_tokens - total)]
        documents += bool(tokens.size)
        while tokens.size:
            split, room = current_split()
            take = min(room - buffered, tokens.size)
            buf.append(tokens[:take])
            buffered += take
            total += take
            tokens = tokens[take:]
            if buffered == room:
                flush(split)
        if max_tokens is not None and total >= max_tokens:
            break
    flush(current_split()[0])
    if counts["train"] == 0:
        raise PrepareError(
            f"only {total:,} tokens, all in the validation split (--val-tokens {val_tokens:,}); "
            "raise --max-tokens or lower --val-tokens"
        )
    return {"shards": shards, "train_tokens": counts["train"], "val_tokens": counts["val"],
            "documents": documents, "eot": eot}


def _stream_texts(dataset: str, config: Optional[str], split: str, field: str) -> Iterable[str]:
    try:
        import datasets
    except ImportError:
        raise PrepareError(
            "the `datasets` package is not installed (pip install datasets); it reads Hugging Face datasets"
        ) from None
    try:
        stream = datasets.load_dataset(dataset, name=config, split=split, streaming=True)
    except Exception as e:
        raise PrepareError(f"could not open dataset {dataset} (config {config}, split {split}): {_one_line(e)}") from None
    try:
        for record in stream:
            if field not in record:
                raise PrepareError(f"records of {dataset} have no field {field!r} (fields: {', '.join(record)})")
            yield record[field]
    except PrepareError:
        raise
    except Exception as e:  # a network failure in the middle of streaming
        raise PrepareError(f"reading {dataset} failed: {_one_line(e)}") from None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.data.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="HuggingFaceFW/fineweb-edu", help="Hugging Face dataset id")
    parser.add_argument("--config", default="sample-10BT", help="dataset configuration (name=); '' for none")
    parser.add_argument("--split", default="train")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--out", required=True, type=Path, help="output folder (then data.path=OUT)")
    parser.add_argument("--prefix", default=None, help="shard file prefix (default: the dataset's name)")
    parser.add_argument("--tokenizer", choices=("bytes", "gpt2"), default="bytes")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    parser.add_argument("--val-tokens", type=int, default=1_000_000)
    parser.add_argument("--max-tokens", type=int, default=None, help="stop after this many tokens in all")
    parser.add_argument("--overwrite", action="store_true", help="replace shards already in --out")
    args = parser.parse_args(argv)
    prefix = args.prefix or args.dataset.rstrip("/").split("/")[-1].replace("-", "_")
    try:
        if args.shard_tokens < 1 or args.val_tokens < 1:
            raise PrepareError("--shard-tokens and --val-tokens must be positive")
        existing = sorted(args.out.glob("*_train_*.bin")) + sorted(args.out.glob("*_val_*.bin"))
        # data.name=shards reads every shard in the folder: two preparations would mix silently.
        if existing and not args.overwrite:
            raise PrepareError(f"{args.out} already holds shards ({existing[0].name}, …); use another --out or --overwrite")
        encode, eot, vocab = gpt2_tokenizer() if args.tokenizer == "gpt2" else byte_tokenizer()
        texts = _stream_texts(args.dataset, args.config or None, args.split, args.text_field)
        # Pull the first record before deleting anything, so a missing package or network leaves
        # an existing preparation intact.
        first = next(iter(texts), None)
        if first is None:
            raise PrepareError(f"dataset {args.dataset} (split {args.split}) is empty")
        for path in existing:
            path.unlink()

        def chained() -> Iterable[str]:
            yield first
            yield from texts

        summary = write_shards(
            chained(), args.out, prefix, encode, eot, args.shard_tokens, args.val_tokens, args.max_tokens,
            log=lambda line: print(line, file=sys.stderr),
        )
    except PrepareError as e:
        print(f"prepare: {e}", file=sys.stderr)
        return 1
    meta = {"dataset": args.dataset, "dataset_config": args.config or None, "split": args.split,
            "text_field": args.text_field, "tokenizer": args.tokenizer, "vocab_size": vocab, **summary}
    write_atomic(args.out / META_FILE, [json.dumps(meta, indent=2).encode()])
    print(f"prepared {summary['train_tokens']:,} train + {summary['val_tokens']:,} val tokens in {args.out}; "
          f"train with data.name=shards data.path={args.out} data.vocab_size={vocab}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
