#!/usr/bin/env python3
"""bench/torch_prefill.py: the peer a user would write for issue 13's forward benchmark — a Llama
prefill (and decode) in PyTorch at the shapes bench_forward_cuda runs, with random bf16 weights made
on the device: RMSNorm, bf16 matmuls, RoPE (rotate_half), causal GQA attention through
torch.nn.functional.scaled_dot_product_attention, SwiGLU; logits of the last position only.

    python3 bench/torch_prefill.py [--device cuda:0] [--shape qwen2.5-1.5b|smollm2|stories]
                                   [--tokens 2048] [--gen 64] [--reps 5]
Prints "torch,<shape>,<device>,bf16,N,<n>,prefill_tok_s,<x>,decode_tok_s,<y>" (medians of reps,
after one warm-up). Decode appends to a preallocated KV cache of N + gen entries.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {  # layers, dim, q heads, KV heads, head dim, FFN, vocab, rope theta (as bench_forward_cuda.c)
    "qwen2.5-1.5b": (28, 1536, 12, 2, 128, 8960, 151936, 1e6),
    "smollm2": (30, 576, 9, 3, 64, 1536, 49152, 1e5),
    "stories": (5, 64, 8, 4, 8, 172, 512, 1e4),
}


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Model:
    def __init__(self, shape, dev, ctx, seed=1):
        L, D, H, G, d, FF, V, theta = SHAPES[shape]
        g = torch.Generator(device=dev).manual_seed(seed)
        dt = torch.bfloat16

        def w(o, i):
            return ((torch.rand(o, i, generator=g, device=dev) * 2 - 1) / i ** 0.5).to(dt)

        self.L, self.D, self.H, self.G, self.d, self.V = L, D, H, G, d, V
        self.emb = (torch.rand(V, D, generator=g, device=dev) * 2 - 1).to(dt)
        self.layers = [dict(wqkv=w(H * d + 2 * G * d, D), wo=w(D, H * d), w13=w(2 * FF, D), w2=w(D, FF),
                            n1=torch.ones(D, device=dev, dtype=dt), n2=torch.ones(D, device=dev, dtype=dt))
                       for _ in range(L)]
        self.nf = torch.ones(D, device=dev, dtype=dt)
        self.wcls = w(V, D)
        inv = 1.0 / theta ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d)
        ang = torch.arange(ctx, device=dev, dtype=torch.float32)[:, None] * inv[None, :]
        self.cos = torch.cat([ang.cos(), ang.cos()], -1).to(dt)
        self.sin = torch.cat([ang.sin(), ang.sin()], -1).to(dt)
        self.k = torch.zeros(L, 1, G, ctx, d, device=dev, dtype=dt)
        self.v = torch.zeros_like(self.k)
        self.ff = FF

    @staticmethod
    def rope(x, cos, sin):
        h = x.shape[-1] // 2
        rot = torch.cat([-x[..., h:], x[..., :h]], -1)
        return x * cos + rot * sin

    def forward(self, tok, p0):
        n = tok.shape[0]
        H, G, d = self.H, self.G, self.d
        x = self.emb[tok][None]  # [1][n][D]
        cos, sin = self.cos[p0:p0 + n], self.sin[p0:p0 + n]
        for l, w in enumerate(self.layers):
            h = F.rms_norm(x, (self.D,), w["n1"], 1e-6)
            qkv = h @ w["wqkv"].T
            q, k, v = qkv.split([H * d, G * d, G * d], -1)
            q = self.rope(q.view(1, n, H, d).transpose(1, 2), cos, sin)
            k = self.rope(k.view(1, n, G, d).transpose(1, 2), cos, sin)
            self.k[l, :, :, p0:p0 + n] = k
            self.v[l, :, :, p0:p0 + n] = v.view(1, n, G, d).transpose(1, 2)
            kc, vc = self.k[l, :, :, :p0 + n], self.v[l, :, :, :p0 + n]
            a = F.scaled_dot_product_attention(q, kc, vc, is_causal=n > 1 and p0 == 0, enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(1, n, H * d) @ w["wo"].T
            h = F.rms_norm(x, (self.D,), w["n2"], 1e-6)
            gate, up = (h @ w["w13"].T).split([self.ff, self.ff], -1)
            x = x + (F.silu(gate) * up) @ w["w2"].T
        return F.rms_norm(x[:, -1], (self.D,), self.nf, 1e-6) @ self.wcls.T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    dev = torch.device(a.device)
    m = Model(a.shape, dev, a.tokens + a.gen)
    tok = (torch.arange(a.tokens + a.gen, device=dev) * 7919 + 13) % m.V
    pre, dec = [], []
    with torch.inference_mode():
        for r in range(a.reps + 1):
            sync(dev)
            t0 = time.perf_counter()
            m.forward(tok[:a.tokens], 0)
            sync(dev)
            t1 = time.perf_counter()
            for i in range(a.gen):
                m.forward(tok[a.tokens + i:a.tokens + i + 1], a.tokens + i)
            sync(dev)
            t2 = time.perf_counter()
            if r:
                pre.append(a.tokens / (t1 - t0))
                dec.append(a.gen / (t2 - t1))
    print(f"torch,{a.shape},{a.device},bf16,N,{a.tokens},prefill_tok_s,{statistics.median(pre):.0f},"
          f"decode_tok_s,{statistics.median(dec):.1f}")


if __name__ == "__main__":
    main()
