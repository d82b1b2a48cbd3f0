#!/usr/bin/env python3
"""bench/torch_sculpt_step.py: the peer a user would write — one batched KVSculpt loss and
gradient step (arXiv 2603.27819 §3) in PyTorch, for B independent (layer, KV head) problems
stacked problem-major, timed against torch's own GEMM ceiling in the same run (issue 12).

Per problem (the retain part taken as always visible: a timing peer, not a reference):
training queries Q [nq][d], references O [nq][d], LSE_zone [nq], a retain part
(o_ret [nq][d], lse_ret [nq]) and k distilled entries Kc, Vc [k][d]:
    s = scale·Q·Kcᵀ, lc = logsumexp(s), pc = σ(lc − lse_ret), Ô = pc·softmax(s)·Vc + (1 − pc)·o_ret
    L = mean‖Ô − O‖² / out_ms + λ·mean (lc − lse_zone)²,  ∂L/∂Kc by autograd.
FLOPs per evaluation with gradient: 8·nq·k·d per problem (as kvmill counts them).

    python3 bench/torch_sculpt_step.py [--device cuda:0] [--shape qwen|smollm2|stories] [--reps 20]
Prints CSV lines: "torch,<shape>,<device>,ms_per_step,<ms>,tflops,<x>,gemm_tflops,<y>".
Synthetic problems (random scores of realistic scale); the timing does not depend on the values.
"""
import argparse
import time

import torch

SHAPES = {  # problems B, queries nq (S + group·m), entries k, head dim d
    "qwen": (28 * 2, 2048 + 6 * 64, 595, 128),      # Qwen2.5-1.5B: 28 layers x 2 KV heads, N 2048, m 64, r 0.3
    "smollm2": (30 * 3, 2048 + 3 * 64, 595, 64),    # SmolLM2-135M: 30 layers x 3 KV heads
    "stories": (5 * 4, 2048 + 2 * 32, 106, 8),      # stories260K: 5 layers x 4 KV heads, N 384, m 32
}


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def loss_fn(kc, vc, q, o, o_ret, lse_ret, lse_zone, out_ms, scale, lam):
    s = torch.bmm(q, kc.transpose(1, 2)) * scale                                            # [B][nq][k]
    lc = torch.logsumexp(s, dim=2)                                                          # [B][nq]
    pc = torch.sigmoid(lc - lse_ret)
    oh = pc.unsqueeze(2) * torch.bmm(torch.softmax(s, dim=2), vc) + (1 - pc).unsqueeze(2) * o_ret
    mse = ((oh - o) ** 2).sum(2).mean(1) / out_ms
    lse = ((lc - lse_zone) ** 2).mean(1)
    return (mse + lam * lse).sum()


def gemm_ceiling(dev, reps):
    a = torch.randn(4096, 4096, device=dev)
    b = torch.randn(4096, 4096, device=dev)
    for _ in range(3):
        a @ b
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(dev)
    return 2 * 4096 ** 3 * reps / (time.perf_counter() - t0) / 1e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="qwen", choices=sorted(SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    dev = torch.device(a.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 like kvmill
    B, nq, k, d = SHAPES[a.shape]
    g = torch.Generator(device="cpu").manual_seed(1)
    q = torch.randn(B, nq, d, generator=g).to(dev)
    kc = (torch.randn(B, k, d, generator=g) * 0.5).to(dev).requires_grad_(True)
    vc = torch.randn(B, k, d, generator=g).to(dev)
    o = torch.randn(B, nq, d, generator=g).to(dev) * 0.1
    o_ret = torch.randn(B, nq, d, generator=g).to(dev) * 0.1
    lse_ret = torch.randn(B, nq, generator=g).to(dev)
    lse_zone = torch.randn(B, nq, generator=g).to(dev) + 2
    out_ms = (o ** 2).sum(2).mean(1)
    args = (vc, q, o, o_ret, lse_ret, lse_zone, out_ms, d ** -0.5, 0.1)
    for _ in range(3):  # warm-up (kernel selection, allocator)
        loss_fn(kc, *args).backward()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(a.reps):
        kc.grad = None
        loss_fn(kc, *args).backward()
    sync(dev)
    dt = (time.perf_counter() - t0) / a.reps
    flops = 8.0 * B * nq * k * d
    print(f"torch,{a.shape},{dev},ms_per_step,{dt * 1e3:.3f},tflops,{flops / dt / 1e12:.3f},"
          f"gemm_tflops,{gemm_ceiling(dev, max(3, a.reps // 4)):.2f}")


if __name__ == "__main__":
    main()
