#!/usr/bin/env python3
"""hf_tiny_reference.py [OUT_DIR]: the reference fixtures of tests/check_hf_tiny.c. For each tiny
Hugging Face configuration below it writes OUT_DIR/NAME/config.json, and OUT_DIR/NAME/reference.txt:
the weight dtype and shard count the test must write, the token ids, and the logits of every
position computed here in float64 numpy by transformers' modelling equations (RMSNorm, rotate_half
RoPE with llama3 frequency scaling, GQA causal attention, SwiGLU, Qwen2 q/k/v biases, Qwen3 q/k
RMSNorm) from the weights tests/util/kvm_test_st.c generates (the same generator, bit for bit).
Needs numpy only. Default OUT_DIR: tests/data/hf/tiny."""
import json
import os
import sys

import numpy as np

M64 = (1 << 64) - 1

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, rms_norm_eps=1e-5,
            rope_theta=10000.0, hidden_act="silu", bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
CASES = {
    # name: (config overrides, dtype, shards)
    "llama_f32": (dict(architectures=["LlamaForCausalLM"]), "F32", 1),
    "llama_bf16_sharded": (dict(architectures=["LlamaForCausalLM"], tie_word_embeddings=True), "BF16", 3),
    "qwen2_bias": (dict(architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True, rope_theta=1000000.0,
                        rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=32), "F32", 1),
    "qwen3_qknorm": (dict(architectures=["Qwen3ForCausalLM"], head_dim=32, rms_norm_eps=1e-6,
                          attention_bias=False), "BF16", 2),
    "llama3_rope": (dict(architectures=["LlamaForCausalLM"], rope_theta=500000.0, eos_token_id=[2, 5],
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=16)), "F32", 1),
    "mistral_window": (dict(architectures=["MistralForCausalLM"], sliding_window=48), "F32", 1),
}
N_TOKENS = 20


def fnv1a64(s):
    h = 14695981039346656037
    for b in s.encode():
        h = ((h ^ b) * 1099511628211) & M64
    return h


def splitmix64(z):
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def weight(name, shape, dtype):
    """kvm_test_tiny_weight for every element, in float32, truncated to bfloat16 when asked."""
    n = int(np.prod(shape))
    h = fnv1a64(name)
    u = np.array([(splitmix64((h + i) & M64) >> 40) - (1 << 23) for i in range(n)], dtype=np.float32)
    if "norm" in name:
        w = np.float32(1.0) + u * np.float32(2.0 ** -25)
    else:
        w = u * np.float32(2.0 ** -23) * np.float32(0.25)
    w = w.astype(np.float32)
    if dtype == "BF16":
        w = (w.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    return w.reshape(shape).astype(np.float64)


def inv_freq(c, hd):
    f = 1.0 / (c["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    rs = c.get("rope_scaling")
    if not rs:
        return f
    omax, lo, hi, fac = rs["original_max_position_embeddings"], rs["low_freq_factor"], rs["high_freq_factor"], rs["factor"]
    wl = 2 * np.pi / f
    scaled = np.where(wl > omax / lo, f / fac, f)
    smooth = (omax / wl - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / fac + smooth * scaled
    medium = ~(wl < omax / hi) & ~(wl > omax / lo)
    return np.where(medium, smoothed, scaled)


def rmsnorm(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def rope(x, cos, sin):
    h = x.shape[-1] // 2
    rot = np.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    return x * cos + rot * sin


def forward(c, dtype, tokens):
    D, F, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    H, KV, V = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
    hd = c.get("head_dim", D // H)
    eps = c["rms_norm_eps"]
    arch = c["architectures"][0]
    bias = arch == "Qwen2ForCausalLM"
    qk_norm = arch == "Qwen3ForCausalLM"
    T = len(tokens)
    w = lambda n, *s: weight(n, s, dtype)
    emb = w("model.embed_tokens.weight", V, D)
    x = emb[tokens]
    ang = np.arange(T, dtype=np.float64)[:, None] * inv_freq(c, hd)[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, axis=-1)[:, None, :]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(L):
        p = "model.layers.%d." % l
        h = rmsnorm(x, w(p + "input_layernorm.weight", D), eps)
        q = h @ w(p + "self_attn.q_proj.weight", H * hd, D).T
        k = h @ w(p + "self_attn.k_proj.weight", KV * hd, D).T
        v = h @ w(p + "self_attn.v_proj.weight", KV * hd, D).T
        if bias:
            q = q + w(p + "self_attn.q_proj.bias", H * hd)
            k = k + w(p + "self_attn.k_proj.bias", KV * hd)
            v = v + w(p + "self_attn.v_proj.bias", KV * hd)
        q, k, v = q.reshape(T, H, hd), k.reshape(T, KV, hd), v.reshape(T, KV, hd)
        if qk_norm:
            q = rmsnorm(q, w(p + "self_attn.q_norm.weight", hd), eps)
            k = rmsnorm(k, w(p + "self_attn.k_norm.weight", hd), eps)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        out = np.zeros((T, H, hd))
        for hh in range(H):
            g = hh // (H // KV)
            s = q[:, hh, :] @ k[:, g, :].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            out[:, hh, :] = (s / s.sum(axis=-1, keepdims=True)) @ v[:, g, :]
        x = x + out.reshape(T, H * hd) @ w(p + "self_attn.o_proj.weight", D, H * hd).T
        h = rmsnorm(x, w(p + "post_attention_layernorm.weight", D), eps)
        gate = h @ w(p + "mlp.gate_proj.weight", F, D).T
        up = h @ w(p + "mlp.up_proj.weight", F, D).T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w(p + "mlp.down_proj.weight", D, F).T
    x = rmsnorm(x, w("model.norm.weight", D), eps)
    cls = emb if c["tie_word_embeddings"] else w("lm_head.weight", V, D)
    return x @ cls.T


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "tests", "data", "hf", "tiny")
    for name, (over, dtype, shards) in CASES.items():
        c = dict(BASE, **over)
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f, indent=2)
            f.write("\n")
        tokens = [(i * 37 + 11) % c["vocab_size"] for i in range(N_TOKENS)]
        logits = forward(c, dtype, tokens)
        with open(os.path.join(d, "reference.txt"), "w") as f:
            f.write("dtype %s shards %d tokens %d vocab %d\n" % (dtype, shards, len(tokens), c["vocab_size"]))
            f.write(" ".join(str(t) for t in tokens) + "\n")
            for row in logits:
                f.write(" ".join("%.9g" % v for v in row) + "\n")
        print("hf_tiny_reference: %s (%s, %d shard(s))" % (d, dtype, shards))


if __name__ == "__main__":
    main()
