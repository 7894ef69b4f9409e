"""When does a small transformer learn associative recall? The first step at which a 2-layer,
d_model 64 model answers a recall task above 90%, for learned against rotary positions and for
torch's default initialisation (embeddings N(0, 1)) against N(0, 0.02) (DecoderLM's default), one
line per batch order (results/pilot/probe_calibration.md, "What delays the lookup").

    python results/pilot/recall_onset.py --positions learned --init torch --data-seed 0

The task is recall_task.py, as in probe_lookup.py --recall;
32 rows a step, AdamW at 3e-3 after 100 warm-up steps, accuracy on 500 held-out rows every 100 steps.
"""
import argparse

import torch
import torch.nn.functional as F
from torch import nn

from attnres.layers import apply_rope, rope_tables
from recall_task import recall_batch  # this folder

ap = argparse.ArgumentParser()
ap.add_argument("--positions", choices=["learned", "rope"], required=True)
ap.add_argument("--init", choices=["torch", "0.02", "embeddings-0.02", "matrices-0.02"], required=True,
                help="N(0, 0.02) on every matrix, on the two embeddings only, or on every other matrix only")
ap.add_argument("--data-seed", type=int, default=0)
ap.add_argument("--steps", type=int, default=3000)
args = ap.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
D, HEADS, LAYERS = 64, 2, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, HEADS, D // HEADS).unbind(2)  # each (B, T, H, hd)
        if args.positions == "rope":
            cos, sin = rope_tables(T, D // HEADS, 10000.0, x.device, x.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.pos = nn.Embedding(256, D), nn.Embedding(128, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, 256)
        for name, p in self.named_parameters():
            embedding = name.startswith(("embed", "pos"))
            if p.dim() == 2 and (args.init == "0.02" or args.init == ("embeddings-0.02" if embedding else "matrices-0.02")):
                nn.init.normal_(p, std=0.02)

    def forward(self, idx):
        x = self.embed(idx) + (self.pos(torch.arange(idx.shape[1])) if args.positions == "learned" else 0)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


gen = torch.Generator().manual_seed(args.data_seed)


model = Model()
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, betas=(0.9, 0.95))
held_x, held_y = recall_batch(500, gen)
scored = held_y != -100
onset, accuracy = None, 0.0
for step in range(args.steps + 1):
    if step % 100 == 0:
        with torch.no_grad():
            accuracy = float((model(held_x).argmax(-1)[scored] == held_y[scored]).float().mean())
        onset = step if onset is None and accuracy > 0.9 else onset
    x, y = recall_batch(32, gen)
    for group in opt.param_groups:
        group["lr"] = 3e-3 * min(1, (step + 1) / 100)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
print(f"positions={args.positions} init={args.init} data_seed={args.data_seed} onset={onset} final={accuracy:.3f}")
