"""Can the default-width baseline learn the probe's 1-hop lookup at all, outside the harness's
training stream? A bare loop over the probe's own examples, printing 1-hop accuracy every 250 steps
(results/pilot/probe_calibration.md, "The lookup alone").

    python results/pilot/probe_lookup.py --layers 2 --lr 3e-3 --steps 4000 --queries 7 --aligned
    python results/pilot/probe_lookup.py --compact --aligned --queries 7   # "xd" pairs, no '=' ';'
    python results/pilot/probe_lookup.py --shifted-copy                    # control: a copy at a fixed offset
    python results/pilot/probe_lookup.py --plain --compact --aligned --n-vars 4 --queries 3 --rows 32 --data-seed 1
    python results/pilot/probe_lookup.py --recall --steps 10000        # control: associative recall, no probe
    python results/pilot/probe_lookup.py --recall --embed-std 1 --init-std 0.125 --ascii --marks --unique --onset --model-seed 2

Each optimizer step sees about 2048 tokens, as a harness step does (batch 16 × 128); the loss is on
the answers only. --aligned: one example per row (no earlier example in the context), else random
128-token windows of the example stream, as the harness trains. 100 held-out prompts per hop count.
--plain: an independent transformer instead of the project's DecoderLM (learned positions,
LayerNorm, torch's MultiheadAttention, GELU MLP, torch's default init), to tell the task from the model.
--data-seed: the order of the batches; --model-seed: the model's initial weights.
--recall's --ascii, --marks, --unique: the probe's differences from the recall control
(recall_task.py); --onset: evaluate every 100 steps and stop at the first above 0.9.
"""
import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from attnres import DecoderLM, ModelConfig, ResidualConfig
from harness.data import MultiHopProbe
from harness.data.multihop import answers_only
from recall_task import recall_batch  # this folder

ap = argparse.ArgumentParser()
ap.add_argument("--hops", default="1")
ap.add_argument("--n-vars", type=int, default=8)
ap.add_argument("--layers", type=int, default=2)
ap.add_argument("--d-model", type=int, default=64)
ap.add_argument("--heads", type=int, default=2)
ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--steps", type=int, default=3000)
ap.add_argument("--wd", type=float, default=0.1, help="AdamW weight decay")
ap.add_argument("--queries", type=int, default=0)
ap.add_argument("--aligned", action="store_true")
ap.add_argument("--compact", action="store_true")
ap.add_argument("--shifted-copy", action="store_true")
ap.add_argument("--plain", action="store_true")
ap.add_argument("--init-std", type=float, default=0.02, help="DecoderLM's model.init_std")
ap.add_argument("--embed-std", type=float, default=None, help="DecoderLM: draw the token embeddings again from N(0, this²)")
ap.add_argument("--recall", action="store_true")
ap.add_argument("--ascii", action="store_true")
ap.add_argument("--marks", action="store_true")
ap.add_argument("--unique", action="store_true")
ap.add_argument("--onset", action="store_true")
ap.add_argument("--data-seed", type=int, default=0)
ap.add_argument("--model-seed", type=int, default=0)
ap.add_argument("--rows", type=int, default=0, help="--aligned: rows per step (default: about 2048 tokens)")
args = ap.parse_args()


class PlainBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Plain(nn.Module):
    def __init__(self, d, heads, layers):
        super().__init__()
        self.embed, self.pos = nn.Embedding(256, d), nn.Embedding(128, d)
        self.blocks = nn.ModuleList(PlainBlock(d, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 256)

    def forward(self, idx, targets=None):
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return logits, None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())


torch.set_num_threads(1)
torch.manual_seed(args.model_seed)
model = (Plain(args.d_model, args.heads, args.layers) if args.plain else
         DecoderLM(ModelConfig(vocab_size=256, d_model=args.d_model, layers=args.layers, n_heads=args.heads,
                               d_ff=3 * args.d_model, max_seq_len=128, init_std=args.init_std),
                   ResidualConfig(name="baseline")))
if args.embed_std is not None and not args.plain:
    torch.nn.init.normal_(model.embed.weight, std=args.embed_std)
opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd, betas=(0.9, 0.95))
gen = torch.Generator().manual_seed(args.data_seed)
start = time.time()


def train_step(x, y, step, clip=True):
    """One AdamW step on (x, y), after 100 linear warm-up steps of the learning rate."""
    for group in opt.param_groups:
        group["lr"] = args.lr * min(1, (step + 1) / 100)
    _, loss = model(x, y)
    opt.zero_grad()
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


if args.shifted_copy:  # 32 random letters twice: the second half is a copy at offset 32
    for step in range(2001):
        r = torch.randint(97, 123, (16, 32), generator=gen)
        x = torch.cat([r, r], 1)
        y = x[:, 1:].clone()
        y[:, :32] = -100
        loss = train_step(x[:, :-1], y, step, clip=False)
        if step % 100 == 0:
            print(step, f"{time.time() - start:.0f}s", f"loss {loss.item():.3f}", flush=True)
    raise SystemExit

if args.recall:  # the associative-recall control (recall_task.py)
    layout = dict(ascii=args.ascii, marks=args.marks, unique=args.unique)
    held_x, held_y = recall_batch(500, gen, **layout)
    for step in range(args.steps + 1):
        if step % (100 if args.onset else 250) == 0:
            model.eval()
            with torch.no_grad():
                scored = held_y != -100
                accuracy = float((model(held_x)[0].argmax(-1)[scored] == held_y[scored]).float().mean())
            print(step, f"{time.time() - start:.0f}s", round(accuracy, 3), flush=True)
            if args.onset and accuracy > 0.9:
                print("onset", step)
                break
            model.train()
        train_step(*recall_batch(args.rows or 32, gen, **layout), step)
    else:
        if args.onset:
            print("onset none")
    raise SystemExit

hops = [int(h) for h in args.hops.split(",")]
probe = MultiHopProbe(hops, args.n_vars, train_examples=200000 if args.aligned else 100000,
                      val_examples=100 * len(hops), queries=args.queries,
                      format="compact" if args.compact else "assign")
examples = probe.train_set()
if args.aligned:
    rows = torch.tensor([list(("\n" + e.text).encode()) for e in examples])
else:
    stream = torch.tensor(list("".join(e.text for e in examples).encode()))
val = {k: ([list(("\n" + e.prompt).encode()) for e in exs], [ord(e.answer) for e in exs])
       for k, exs in probe.val_set().items()}


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
        batch = rows[torch.randint(0, rows.shape[0], (args.rows or max(1, 2048 // (rows.shape[1] - 1)),), generator=gen)]
    else:
        starts = torch.randint(0, stream.numel() - 129, (16,), generator=gen)
        batch = torch.stack([stream[i:i + 129] for i in starts])
    x, y = batch[:, :-1], batch[:, 1:]
    train_step(x, answers_only(x, y, compact=args.compact), step)
