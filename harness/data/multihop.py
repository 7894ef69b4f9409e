"""A synthetic multi-hop probe: does depth routing help a model follow chains of assignments?

An example is a shuffled list of single-letter assignments and a query whose digit answer takes
k hops to find, e.g. (k = 4) ``c=b;x=3;a=7;d=c;b=a;y=x;?d=7``, or in the compact format
``cbx3a7dcbayx?d7`` (two characters a statement). Every example has the same length whatever k,
distractor chains hide the target's length, and generation is seeded by string (SHA-512), so
examples are identical on every machine; docs/DATA.md gives the rules.
"""
from __future__ import annotations

import hashlib
import random
import string
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from .datatypes import FORMATS, DataConfig, DataError

SEPARATOR = "\n"
LETTERS = string.ascii_lowercase
DIGITS = string.digits


@dataclass(frozen=True)
class Example:
    prompt: str  # statements and the query, up to and including "?x=" ("?x" compact)
    answer: str  # the digit
    k: int  # hops
    extra: str = ""  # further queries with their answers, "?y=3?z=7" (MultiHopProbe queries)

    @property
    def text(self) -> str:
        return self.prompt + self.answer + self.extra + SEPARATOR


def resolve(prompt: str) -> tuple[str, int]:
    """(answer, hops) of a prompt in either format, found by following its assignments; used to
    verify examples."""
    body, _, query = prompt.rpartition("?")
    if "=" in prompt:
        env = dict(s.split("=", 1) for s in body.split(";") if s)
    else:  # compact: two characters a statement
        env = {body[i]: body[i + 1] for i in range(0, len(body), 2)}
    var, hops = query.rstrip("="), 0
    seen = set()
    while var in env:
        if var in seen:
            raise ValueError(f"cyclic assignments in {prompt!r}")
        seen.add(var)
        var, hops = env[var], hops + 1
    return var, hops


def answers_only(x: torch.Tensor, y: torch.Tensor, compact: bool = False) -> torch.Tensor:
    """The targets ``y`` of inputs ``x`` with every position but the answers set to -100, the
    index cross-entropy ignores: a target is an answer when the input before it ends a query,
    "?v=" or, compact, "?v" (which needs the query's "?" inside the window)."""
    answer = torch.zeros_like(y, dtype=torch.bool)
    if compact:
        answer[:, 1:] = x[:, :-1] == ord("?")
    else:
        answer[:, 2:] = (x[:, 2:] == ord("=")) & (x[:, :-2] == ord("?"))
    return y.masked_fill(~answer, -100)


class MultiHopProbe:
    def __init__(
        self,
        hops: Sequence[int] = (1, 2, 3, 4),
        n_vars: int = 12,
        train_examples: int = 20000,
        val_examples: int = 800,
        seed: int = 0,
        queries: int = 0,
        format: str = "assign",
        aligned: bool = False,
    ):
        self.hops = tuple(int(k) for k in hops)
        if format not in FORMATS:
            raise DataError(f"data.format={format!r}: allowed: {', '.join(FORMATS)}")
        self.format, self.aligned = format, bool(aligned)
        # statement "x=3;" and query "?x=", or compact "x3" and "?x"
        self._eq, self._end = ("=", ";") if format == "assign" else ("", "")
        self.queries = int(queries)
        if not 0 <= self.queries < int(n_vars):
            raise DataError(f"data.queries={self.queries}: must be between 0 and data.n_vars - 1 "
                            f"({int(n_vars) - 1}), one query per other variable at most")
        self.n_vars, self.seed = int(n_vars), int(seed)
        self.train_examples, self.val_examples = int(train_examples), int(val_examples)
        if not self.hops or min(self.hops) < 1:
            raise DataError(f"data.hops={list(self.hops)}: needs at least one hop count, each >= 1")
        if not max(self.hops) <= self.n_vars <= len(LETTERS):
            raise DataError(
                f"data.n_vars={self.n_vars}: must be between max(data.hops)={max(self.hops)} "
                f"and {len(LETTERS)} (one letter per variable)"
            )
        if self.train_examples < 1 or self.val_examples < len(self.hops):
            raise DataError(
                f"data.train_examples={self.train_examples}, data.val_examples={self.val_examples}: "
                f"need >= 1 training example and >= one validation example per hop count ({len(self.hops)})"
            )
        self._val: Optional[dict[int, list[Example]]] = None
        self._train: Optional[list[Example]] = None

    @classmethod
    def from_config(cls, cfg: DataConfig) -> "MultiHopProbe":
        return cls(cfg.hops, cfg.n_vars, cfg.train_examples, cfg.val_examples, cfg.seed,
                   cfg.queries, cfg.format, cfg.aligned)

    @property
    def prompt_len(self) -> int:
        """Tokens per prompt: n_vars statements "x=y;" and the query "?x=" (compact: "xy", "?x")."""
        return (2 + len(self._eq) + len(self._end)) * self.n_vars + 2 + len(self._eq)

    @property
    def example_len(self) -> int:
        """Tokens per example: the prompt, the digit, `queries` more "?y=d" ("?yd"), the newline."""
        return self.prompt_len + 1 + (3 + len(self._eq)) * self.queries + 1

    # --- generation ----------------------------------------------------------------------------
    def _rng(self, split: str, k: int) -> random.Random:
        return random.Random(f"attnres-multihop:{self.seed}:{split}:{k}")

    def make_example(self, k: int, rng: random.Random) -> Example:
        names = rng.sample(LETTERS, self.n_vars)
        answer = rng.choice(DIGITS)
        others = [d for d in DIGITS if d != answer]
        chain = names[:k]
        statements = [(chain[0], answer)] + [(chain[i], chain[i - 1]) for i in range(1, k)]
        rest, longest = names[k:], max(self.hops)
        while rest:
            length = min(rng.randint(1, longest), len(rest))
            links, rest = rest[:length], rest[length:]
            statements.append((links[0], rng.choice(others)))
            statements += [(links[i], links[i - 1]) for i in range(1, length)]
        rng.shuffle(statements)
        eq, end = self._eq, self._end
        prompt = "".join(f"{var}{eq}{value}{end}" for var, value in statements) + f"?{chain[-1]}{eq}"
        extra = ""
        if self.queries:
            env = dict(statements)
            for var in rng.sample([v for v in names if v != chain[-1]], self.queries):
                value = var
                while value in env:  # follow the chain to its digit
                    value = env[value]
                extra += f"?{var}{eq}{value}"
        return Example(prompt, answer, k, extra)

    def val_set(self) -> dict[int, list[Example]]:
        """The held-out examples by hop count (val_examples // len(hops) each)."""
        if self._val is None:
            per_hop = self.val_examples // len(self.hops)
            self._val = {}
            for k in self.hops:
                rng = self._rng("val", k)
                self._val[k] = [self.make_example(k, rng) for _ in range(per_hop)]
        return self._val

    def train_set(self) -> list[Example]:
        """Training examples, hop counts balanced over `hops` and shuffled."""
        if self._train is None:
            held_out = {ex.prompt for exs in self.val_set().values() for ex in exs}
            rng = self._rng("train", 0)
            ks = [self.hops[i % len(self.hops)] for i in range(self.train_examples)]
            rng.shuffle(ks)
            out = []
            for k in ks:
                ex = self.make_example(k, rng)
                while ex.prompt in held_out:
                    ex = self.make_example(k, rng)
                out.append(ex)
            self._train = out
        return self._train

    def tokens(self, split: str) -> torch.Tensor:
        examples: Iterable[Example]
        if split == "train":
            examples = self.train_set()
        elif split == "val":
            examples = [ex for k in self.hops for ex in self.val_set()[k]]
        else:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        # aligned: a leading newline, so that the window at each multiple of example_len is one
        # example after the newline that ends the one before, as the accuracy's prompts begin
        lead = SEPARATOR if self.aligned else ""
        data = bytearray((lead + "".join(ex.text for ex in examples)).encode("ascii"))
        return torch.frombuffer(data, dtype=torch.uint8).clone()

    def fingerprint(self, train: torch.Tensor, val: torch.Tensor) -> dict:
        digest = hashlib.sha256()
        for split, t in (("train", train), ("val", val)):
            digest.update(f"{split}\0{t.numel()}\0".encode())
            digest.update(t.numpy().tobytes())
        return {
            "source": "multihop", "files": 0, "bytes": train.numel() + val.numel(),
            "train_tokens": train.numel(), "val_tokens": val.numel(), "sha256": digest.hexdigest(),
            "tokenizer": "bytes", "hops": list(self.hops), "n_vars": self.n_vars,
            "train_examples": self.train_examples, "val_examples": self.val_examples, "seed": self.seed,
            **({"queries": self.queries} if self.queries else {}),
            **({"format": self.format} if self.format != "assign" else {}),
            **({"aligned": True} if self.aligned else {}),
        }

    # --- scoring -------------------------------------------------------------------------------
    def copy_accuracy(self) -> dict[int, float]:
        """Per hop count, the accuracy of answering with a uniformly drawn digit of the prompt (the
        answer is always one of them): what a model that follows no chain can reach, above 1/10
        whenever the prompt holds few digits. The probe is learned at k hops only above this."""
        return {k: sum(1 / len({c for c in ex.prompt if c in DIGITS}) for ex in exs) / len(exs)
                for k, exs in self.val_set().items() if exs}

    @torch.no_grad()
    def accuracy(
        self,
        model: torch.nn.Module,
        device: torch.device | str = "cpu",
        max_per_hop: Optional[int] = None,
        batch_size: int = 256,
    ) -> dict[int, float]:
        """Greedy exact-match accuracy of the answer, per hop count, on the validation examples.

        `model(idx)` must return (logits, loss) with logits of shape (B, T, vocab). The model's
        train/eval mode is restored afterwards.
        """
        was_training = model.training
        model.eval()
        try:
            result = {}
            for k in self.hops:
                examples = self.val_set()[k][:max_per_hop]
                correct = 0
                for i in range(0, len(examples), batch_size):
                    chunk = examples[i : i + batch_size]
                    idx = torch.tensor(
                        [list((SEPARATOR + ex.prompt).encode("ascii")) for ex in chunk],
                        dtype=torch.long, device=device,
                    )
                    targets = torch.tensor(
                        [list(ex.answer.encode("ascii")) for ex in chunk], dtype=torch.long, device=device
                    )
                    ok = torch.ones(len(chunk), dtype=torch.bool, device=device)
                    for j in range(targets.shape[1]):
                        logits, _ = model(idx)
                        nxt = logits[:, -1, :].argmax(dim=-1)
                        ok &= nxt == targets[:, j]
                        idx = torch.cat([idx, nxt[:, None]], dim=1)
                    correct += int(ok.sum())
                result[k] = correct / len(examples) if examples else float("nan")
            return result
        finally:
            model.train(was_training)
