#!/usr/bin/env python3
"""gguf_to_hf.py GGUF OUT_DIR: writes a Hugging Face folder (config.json, model.safetensors in
float32, tokenizer.json, tokenizer_config.json, generation_config.json) from a llama-architecture
GGUF file with a byte-level BPE ("gpt2") vocabulary, using only PyPI packages (gguf, numpy,
safetensors, tokenizers; no torch). Weights are dequantised to float32 by gguf's own
dequantisers; llama.cpp's converter permuted the rows of Q and K so that ggml's adjacent-pair
RoPE applies, and this undoes it (as transformers' GGUF loader does), giving the half-split
layout Hugging Face models use. Run by scripts/gguf-to-hf.sh."""
import json
import os
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

# llama.cpp GGUF names -> transformers Llama names, per block
BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_up": "mlp.up_proj",
}
# tokenizer.ggml.pre -> Hugging Face pre-tokenizers (the ones kvmill's GGUF reader knows)
PRE = {
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
}


def field(r, key, default=None):
    f = r.fields.get(key)
    if f is None:
        return default
    if f.types and f.types[0].name == "ARRAY":
        return [f.contents(i) for i in range(len(f.data))]
    return f.contents()


def unpermute(w, n_head):
    """Inverse of llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (rows of Q or K)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def weights(r, n_head, n_kv):
    out = {}
    for t in r.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(x) for x in reversed(t.shape)])
        name = t.name
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name.startswith("blk."):
            _, layer, part, kind = name.split(".")
            if part == "attn_q":
                w = unpermute(w, n_head)
            elif part == "attn_k":
                w = unpermute(w, n_kv)
            hf = "model.layers.%s.%s.%s" % (layer, BLOCK[part], kind)
        else:
            fail("tensor %s has no Hugging Face name" % name)
        out[hf] = np.ascontiguousarray(w)
    return out


def config(r, tied):
    a = "llama."
    n_head = int(field(r, a + "attention.head_count"))
    dim = int(field(r, a + "embedding_length"))
    eos = int(field(r, "tokenizer.ggml.eos_token_id"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dim,
        "intermediate_size": int(field(r, a + "feed_forward_length")),
        "num_hidden_layers": int(field(r, a + "block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(field(r, a + "attention.head_count_kv", n_head)),
        "head_dim": dim // n_head,
        "vocab_size": len(field(r, "tokenizer.ggml.tokens")),
        "max_position_embeddings": int(field(r, a + "context_length")),
        "rms_norm_eps": float(field(r, a + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(field(r, a + "rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "bos_token_id": int(field(r, "tokenizer.ggml.bos_token_id", eos)),
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def tokenizer(r):
    if field(r, "tokenizer.ggml.model") != "gpt2":
        fail("only byte-level BPE (tokenizer.ggml.model = gpt2) vocabularies are converted")
    pre = field(r, "tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE:
        fail("tokenizer.ggml.pre %r has no Hugging Face equivalent here" % pre)
    toks = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type", [1] * len(toks))
    merges = [tuple(m.split(" ", 1)) for m in field(r, "tokenizer.ggml.merges")]
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(toks)}, merges=merges))
    tk.pre_tokenizer = PRE[pre]()
    tk.decoder = decoders.ByteLevel()
    # CONTROL (3) tokens are special, USER_DEFINED (4) plain added tokens
    added = [AddedToken(t, special=ty == 3, normalized=False) for t, ty in zip(toks, types) if ty in (3, 4)]
    tk.add_tokens(added)
    return tk, toks


def fail(msg):
    """Bad input (the file, the folder, what the file holds): exit 2, as kvmill does."""
    print("gguf_to_hf: " + msg, file=sys.stderr)
    sys.exit(2)


def open_gguf(src):
    """GGUFReader's own errors are tracebacks: a missing file, a folder, a file of another format."""
    if not os.path.isfile(src):
        fail("GGUF %s: %s" % (src, "is a folder, not a file" if os.path.isdir(src) else "no such file"))
    try:
        return GGUFReader(src)
    except OSError as e:
        fail("GGUF %s: cannot read: %s" % (src, e.strerror or e))
    except ValueError as e:  # a bad magic, an empty file, a truncated header
        fail("GGUF %s: not a GGUF file (%s)" % (src, e))


def main():
    if len(sys.argv) != 3:
        fail("usage: gguf_to_hf.py GGUF OUT_DIR")
    src, out = sys.argv[1], sys.argv[2]
    if os.path.exists(out) and not os.path.isdir(out):
        fail("OUT_DIR %s exists and is not a folder" % out)
    r = open_gguf(src)
    if field(r, "general.architecture") != "llama":
        fail("GGUF %s: architecture %r: only llama is converted" % (src, field(r, "general.architecture")))
    n_head = int(field(r, "llama.attention.head_count"))
    n_kv = int(field(r, "llama.attention.head_count_kv", n_head))
    w = weights(r, n_head, n_kv)
    cfg = config(r, "lm_head.weight" not in w)
    os.makedirs(out, exist_ok=True)
    st = os.path.join(out, "model.safetensors")
    save_file(w, st, metadata={"format": "pt"})
    umask = os.umask(0)  # save_file writes through a private (0600) temporary: give it the umask's
    os.umask(umask)      # mode, as the folder's other files get, so others who read the folder can load it
    os.chmod(st, 0o666 & ~umask)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, f, indent=2)
    tk, toks = tokenizer(r)
    tk.save(os.path.join(out, "tokenizer.json"))
    tc = {"bos_token": toks[cfg["bos_token_id"]], "eos_token": toks[cfg["eos_token_id"]],
          "add_bos_token": bool(field(r, "tokenizer.ggml.add_bos_token", False)),
          "tokenizer_class": "GPT2Tokenizer"}
    tmpl = field(r, "tokenizer.chat_template")
    if tmpl:
        tc["chat_template"] = tmpl
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=2)
    print("gguf_to_hf: wrote %s (%d tensors, float32)" % (out, len(w)))


if __name__ == "__main__":
    main()
