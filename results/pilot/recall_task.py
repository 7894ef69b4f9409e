"""The associative-recall control of probe_lookup.py --recall and recall_onset.py: 4 keys (tokens
1-26) and their values (27-36), a separator (0), then every key asked once in a shuffled order;
only the value after each asked key is scored."""
import torch


def recall_batch(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.stack([torch.randperm(26, generator=gen)[:4] for _ in range(n)]) + 1
    values = torch.randint(27, 37, (n, 4), generator=gen)
    order = torch.stack([torch.randperm(4, generator=gen) for _ in range(n)])
    asked = torch.stack([keys.gather(1, order), values.gather(1, order)], 2).flatten(1)
    x = torch.cat([torch.stack([keys, values], 2).flatten(1), torch.zeros(n, 1, dtype=torch.long), asked], 1)
    y = x[:, 1:].clone()
    y[:, :9] = -100  # the context, and the first query's key
    y[:, 10::2] = -100  # the other keys: only the values after a key are scored
    return x[:, :-1], y
