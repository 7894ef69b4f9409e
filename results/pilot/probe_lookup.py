"""Can the default-width baseline learn the probe's 1-hop lookup at all, outside the harness's
training stream? A bare loop over the probe's own examples, printing 1-hop accuracy every 250 steps
(results/pilot/probe_calibration.md, "The lookup alone").

    python results/pilot/probe_lookup.py --layers 2 --lr 3e-3 --steps 4000 --queries 7 --aligned
    python results/pilot/probe_lookup.py --compact --aligned --queries 7   # "xd" pairs, no '=' ';'
    python results/pilot/probe_lookup.py --shifted-copy                    # control: a copy at a fixed offset

Each optimizer step sees about 2048 tokens, as a harness step does (batch 16 × 128); the loss is on
the answers only. --aligned: one example per row (no earlier example in the context), else random
128-token windows of the example stream, as the harness trains. 100 held-out prompts per hop count.
"""
import argparse
import time

import torch

from attnres import DecoderLM, ModelConfig, ResidualConfig
from harness.data import MultiHopProbe
from harness.data.multihop import answers_only

ap = argparse.ArgumentParser()
ap.add_argument("--hops", default="1")
ap.add_argument("--n-vars", type=int, default=8)
ap.add_argument("--layers", type=int, default=2)
ap.add_argument("--d-model", type=int, default=64)
ap.add_argument("--heads", type=int, default=2)
ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--steps", type=int, default=3000)
ap.add_argument("--queries", type=int, default=0)
ap.add_argument("--aligned", action="store_true")
ap.add_argument("--compact", action="store_true")
ap.add_argument("--shifted-copy", action="store_true")
args = ap.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
model = DecoderLM(ModelConfig(vocab_size=256, d_model=args.d_model, layers=args.layers, n_heads=args.heads,
                              d_ff=3 * args.d_model, max_seq_len=128), ResidualConfig(name="baseline"))
opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
gen = torch.Generator().manual_seed(0)
start = time.time()

if args.shifted_copy:  # 32 random letters twice: the second half is a copy at offset 32
    for step in range(2001):
        r = torch.randint(97, 123, (16, 32), generator=gen)
        x = torch.cat([r, r], 1)
        y = x[:, 1:].clone()
        y[:, :32] = -100
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1, (step + 1) / 100)
        _, loss = model(x[:, :-1], y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            print(step, f"{time.time() - start:.0f}s", f"loss {loss.item():.3f}", flush=True)
    raise SystemExit

hops = [int(h) for h in args.hops.split(",")]
probe = MultiHopProbe(hops, args.n_vars, train_examples=200000 if args.aligned else 100000,
                      val_examples=100 * len(hops), queries=args.queries)
encode = (lambda s: s.replace("=", "").replace(";", "")) if args.compact else (lambda s: s)
examples = probe.train_set()
if args.aligned:
    rows = torch.tensor([list(("\n" + encode(e.text)).encode()) for e in examples])
else:
    stream = torch.tensor(list("".join(encode(e.text) for e in examples).encode()))
val = {k: ([list(("\n" + encode(e.prompt)).encode()) for e in exs], [ord(e.answer) for e in exs])
       for k, exs in probe.val_set().items()}


def answers(x, y):  # the digit after "?v=" (or "?v" in the compact form)
    if not args.compact:
        return answers_only(x, y)
    mask = torch.zeros_like(y, dtype=torch.bool)
    mask[:, 1:] = x[:, :-1] == ord("?")
    return y.masked_fill(~mask, -100)


@torch.no_grad()
def accuracy():
    model.eval()
    out = {k: round(float((model(torch.tensor(p))[0][:, -1].argmax(-1) == torch.tensor(a)).float().mean()), 3)
           for k, (p, a) in val.items()}
    model.train()
    return out


print("copy level", {k: round(v, 3) for k, v in probe.copy_accuracy().items()}, flush=True)
for step in range(args.steps + 1):
    if step % 250 == 0:
        print(step, f"{time.time() - start:.0f}s", accuracy(), flush=True)
    if args.aligned:
        batch = rows[torch.randint(0, rows.shape[0], (max(1, 2048 // (rows.shape[1] - 1)),), generator=gen)]
    else:
        starts = torch.randint(0, stream.numel() - 129, (16,), generator=gen)
        batch = torch.stack([stream[i:i + 129] for i in starts])
    x, y = batch[:, :-1], batch[:, 1:]
    for group in opt.param_groups:
        group["lr"] = args.lr * min(1, (step + 1) / 100)
    _, loss = model(x, answers(x, y))
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
