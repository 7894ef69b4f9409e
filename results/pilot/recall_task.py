"""The associative-recall control of probe_lookup.py --recall and recall_onset.py: 4 keys (tokens
1-26) and their values (27-36), a separator (0), then every key asked once in a shuffled order;
only the value after each asked key is scored.

The options move it toward the probe's compact rows one difference at a time: `ascii` (keys are
the letters' bytes, values the digits', the separator "?"), `marks` (a newline before and after
the row and a separator before each asked key instead of one between the halves) and `unique`
(the first asked key's value held by no other key). Without them the draws are the original's."""
import torch


def recall_batch(n: int, gen: torch.Generator, ascii: bool = False, marks: bool = False,
                 unique: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.stack([torch.randperm(26, generator=gen)[:4] for _ in range(n)])
    values = torch.randint(0, 10, (n, 4), generator=gen)
    order = torch.stack([torch.randperm(4, generator=gen) for _ in range(n)])
    if unique:  # a value for the first asked key among the digits the other three do not hold
        others = torch.ones(n, 4).scatter_(1, order[:, :1], 0.0)  # the other three keys' columns
        held = torch.zeros(n, 10).scatter_add_(1, values, others) > 0
        free = torch.rand(n, 10, generator=gen).masked_fill(held, -1.0).argmax(1)
        values.scatter_(1, order[:, :1], free[:, None])
    key_base, value_base, sep, newline = (ord("a"), ord("0"), ord("?"), ord("\n")) if ascii else (1, 27, 0, 37)
    keys, values = keys + key_base, values + value_base
    pairs = torch.stack([keys, values], 2).flatten(1)
    asked = torch.stack([keys.gather(1, order), values.gather(1, order)], 2)  # (n, 4, 2)
    column = lambda token: torch.full((n, 1), token, dtype=torch.long)
    if marks:
        asked = torch.cat([torch.full((n, 4, 1), sep, dtype=torch.long), asked], 2).flatten(1)
        x = torch.cat([column(newline), pairs, asked, column(newline)], 1)
        first, period = 1 + 8 + 2, 3  # the first asked value, then one every 3 tokens
    else:
        x = torch.cat([pairs, column(sep), asked.flatten(1)], 1)
        first, period = 8 + 2, 2
    answer = torch.zeros_like(x, dtype=torch.bool)
    answer[:, first : first + 4 * period : period] = True
    y = x[:, 1:].masked_fill(~answer[:, 1:], -100)
    return x[:, :-1], y
