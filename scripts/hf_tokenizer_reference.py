#!/usr/bin/env python3
"""hf_tokenizer_reference.py [SMOLLM2_HF_DIR]: the fixtures of tests/check_hf_tokenizer.c.

Writes tests/data/hf/tokenizers/strings.json (a few hundred varied strings: text from
../shared/data, code, numbers, emoji, CJK and other scripts, whitespace runs, special tokens,
contractions), and for each tokenizer NAME, tests/data/hf/tokenizers/NAME/ids.json: the ids the
Hugging Face `tokenizers` library gives each string (encode(s, add_special_tokens=False)), and
BOS/add_bos from its post-processor. Tokenizers:
- smollm2: the tokenizer.json of the folder scripts/gguf-to-hf.sh writes from the SmolLM2 GGUF
  (only when SMOLLM2_HF_DIR is given; the folder itself is not committed);
- small ones trained here on ../shared/data (tokenizer.json committed beside ids.json):
  qwen_style (NFC, Qwen2's split regex, ByteLevel without regex, "a b" merges), llama3_style (Llama-3's
  regex, ignore_merges, a BOS template, merges stored as pairs), spm_style (Llama-2/Mistral:
  Prepend + Replace normalizer, byte fallback, <s> template) and metaspace_style (Metaspace
  pre-tokenizer with prepend_scheme "first", byte fallback).
Needs the tokenizers package (scripts/gguf-to-hf.sh installs it)."""
import glob
import json
import os
import random
import sys

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "tests", "data", "hf", "tokenizers")
SHARED = os.environ.get("KVMILL_SHARED", os.path.join(ROOT, "..", "shared"))

QWEN_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
           r"\s+(?!\S)|\s+")
LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
             r"\s*[\r\n]+|\s+(?!\S)|\s+")
SYNTH = [
    "def f(x):\n    return x ** 2  # square\n", "int main(void) { printf(\"%d\\n\", 42); return 0; }",
    "for (size_t i = 0; i < n; i++) {\n\tsum += a[i];\n}", "SELECT * FROM t WHERE id = 7;",
    "<html><body class=\"x\">Hi</body></html>", "{\"key\": [1, 2, 3], \"ok\": true}",
    "3.14159 2.71828 1e-10 -42 1,000,000 0x1F 007", "2026-12-01 09:00:00 UTC", "12345678901234567890",
    "😀 🎉 👍🏽 👨‍👩‍👧 🇫🇷", "日本語のテキストです。", "中文文本，测试一下。", "한국어 문장입니다.",
    "Ελληνικά κείμενα", "Русский текст, тест.", "עברית", "العربية", "हिन्दी पाठ", "ไทย",
    "café naïve résumé Ångström", "e\u0301 vs \u00e9 (combining accent)", "ﬁ ligature and ① circled",
    "   leading spaces", "trailing spaces   ", "tabs\t\tand\nnewlines\n\n\n", " \n \n  \t ", "a  b   c    d",
    "\r\nwindows\r\nlines", "", " ", "\n", "x",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>", "text<|im_end|>more",
    "<s> not special here </s>", "<unk>", "<0x41> literal byte token text",
    "I'm sure you'll see they've done it; we'd go. DON'T SHOUT. It's", "isn't aren't won't can't",
    "https://example.com/path?q=1&r=two#frag", "user@example.org", "C:\\Windows\\System32", "~/.config/kvmill.ini",
    "!!! ??? ... --- *** ### @@@", "(a) [b] {c} <d>", "«quotes» „more“ ‘single’", "math: ∑ ∫ √ ∞ ≠ ≤",
    "mixed 123abc456 def789", "ALLCAPS lowercase CamelCase snake_case kebab-case",
]


def strings():
    rnd = random.Random(16)
    out = list(SYNTH)
    files = sorted(glob.glob(os.path.join(SHARED, "data", "*", "*.txt")))
    for path in files[:40]:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for _ in range(6):
            n = rnd.choice([20, 60, 200, 600])
            i = rnd.randrange(max(1, len(text) - n))
            out.append(text[i:i + n])
    for _ in range(40):  # random mixes of the synthetic pieces
        out.append(rnd.choice(SYNTH) + rnd.choice(["", " ", "\n", "  "]) + rnd.choice(SYNTH))
    return out


def corpus():
    for path in sorted(glob.glob(os.path.join(SHARED, "data", "*", "*.txt")))[:200]:
        with open(path, encoding="utf-8") as f:
            yield f.read()
    yield from SYNTH * 20


def train_bytelevel(name):
    tk = Tokenizer(models.BPE())
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    if name == "qwen_style":
        tk.normalizer = normalizers.NFC()
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_RE), "isolated"),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_RE), "isolated"),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=800, special_tokens=specials, show_progress=False,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(corpus(), tr)
    j = json.loads(tk.to_str())
    if name == "qwen_style":  # merges in the older "a b" string form (byte-level tokens hold no spaces)
        j["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in j["model"]["merges"]]
    if name == "llama3_style":
        j["model"]["ignore_merges"] = True
        j["model"]["merges"] = [m.split(" ", 1) if isinstance(m, str) else m for m in j["model"]["merges"]]
        bos = "<|begin_of_text|>"
        j["post_processor"] = json.loads(processors.TemplateProcessing(
            single=bos + " $A", special_tokens=[(bos, tk.token_to_id(bos))]).__getstate__())
    return json.dumps(j, ensure_ascii=False)


def train_spm(name):
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    if name == "spm_style":
        tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tr = trainers.BpeTrainer(vocab_size=700, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tk.train_from_iterator(corpus(), tr)
    j = json.loads(tk.to_str())
    vocab = j["model"]["vocab"]
    # byte-fallback tokens after the specials, as Llama-2's vocabulary has them
    new = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        new["<0x%02X>" % b] = 3 + b
    for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
        if t not in new:
            new[t] = len(new)
    j["model"]["vocab"] = new
    j["model"]["byte_fallback"] = True
    for a in j["added_tokens"]:
        a["id"] = new[a["content"]]
    j["post_processor"] = json.loads(processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]).__getstate__())
    j["decoder"] = None
    return json.dumps(j, ensure_ascii=False)


def write_ids(name, tk, texts):
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    enc = tk.encode("x", add_special_tokens=True).ids
    plain = tk.encode("x", add_special_tokens=False).ids
    ids = [tk.encode(s, add_special_tokens=False).ids for s in texts]
    with open(os.path.join(d, "ids.json"), "w") as f:
        json.dump({"add_bos": len(enc) > len(plain), "bos": enc[0] if len(enc) > len(plain) else -1, "ids": ids}, f)
    print("hf_tokenizer_reference: %s: %d strings, %d ids" % (name, len(ids), sum(len(x) for x in ids)))


def main():
    texts = strings()
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "strings.json"), "w") as f:
        json.dump(texts, f, ensure_ascii=False, indent=0)
    if len(sys.argv) > 1:
        write_ids("smollm2", Tokenizer.from_file(os.path.join(sys.argv[1], "tokenizer.json")), texts)
    for name, make in [("qwen_style", train_bytelevel), ("llama3_style", train_bytelevel),
                       ("spm_style", train_spm), ("metaspace_style", train_spm)]:
        text = make(name)  # written as built, so the merge forms stay as chosen
        d = os.path.join(OUT, name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(text)
        write_ids(name, Tokenizer.from_file(os.path.join(d, "tokenizer.json")), texts)


if __name__ == "__main__":
    main()
