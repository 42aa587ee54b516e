"""llama.cpp (through llama-cpp-python) as the reference for kiln's tokenizer.

    python llama_cpp_tokenize.py make-vocab KIND OUT.gguf SEED
        KIND: spm (SentencePiece `llama`, byte-fallback tokens, scores), or a byte-level `gpt2`
        pre-tokenizer name (qwen2, llama-bpe, default, gpt-2, starcoder) with merges learnt here
        by a small seeded BPE trainer. Written with
        gguf-py, llama.cpp's own GGUF package. KIND+bad-ids (spm, qwen2): EOS, EOT and padding
        ids outside the vocabulary.
    python llama_cpp_tokenize.py reference MODEL.gguf < request.json
        request: {"cases": [{"text": str, "add_special": bool, "parse_special": bool}]}
        answer:  {"tokens": [[id]], "detok": [hex], "pieces": [hex per token id],
                  "eog": [id], "bos": id, "eos": id, "n_vocab": n}
        tokens from Llama(vocab_only=True).tokenize; detok from llama_detokenize(ids,
        remove_special=False, unparse_special=True) of those tokens; pieces from
        llama_token_to_piece(id, lstrip=0, special=True).
"""
import ctypes
import json
import random
import sys

import gguf

# Text the synthetic vocabularies are learnt from: prose, code, numbers, several scripts.
TRAIN = """The quick brown fox jumps over the lazy dog. It's a test, isn't it? We'll see what they've done.
def main(argv):
    for i in range(10):
        print(f"value {i}: {argv[i]!r}")
    return 0
Numbers: 3.14159 2718281828 1,000,000 0x1F 2024-10-11
Café naïve résumé façade Straße Übermut Ærøskøbing
日本語のテキスト 中文文本 한국어 텍스트 Русский текст Ελληνικά
emoji 😀🎉👍🏽 and combining e\u0301 a\u0308
<|im_start|>user hello<|im_end|>
$a = $b + $c; $d .= $e; a $f $g ~h ^i |j +k <l> x += y -> z => w
"""

SPECIALS_BPE = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WHOLE_WORDS = ["hello", "Hello", " world", " the", "the", "123", "Straße", "   ", "\n\n", "naïve",
               "中文", " f", "return", "'s", "...", "4567890123"]


def byte_chars():
    bs = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def train_bpe(words, n_merges):
    """Greedy BPE over byte-encoded words: returns merges "a b" in rank order."""
    seqs = {}
    for w in words:
        t = tuple(w)
        seqs[t] = seqs.get(t, 0) + 1
    merges = []
    for _ in range(n_merges):
        pairs = {}
        for s, c in seqs.items():
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + c
        if not pairs:
            break
        best = max(sorted(pairs), key=lambda p: pairs[p])
        if pairs[best] < 2:
            break
        merges.append(best)
        new = {}
        for s, c in seqs.items():
            out = []
            i = 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(s[i] + s[i + 1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            new[tuple(out)] = new.get(tuple(out), 0) + c
        seqs = new
    return merges


def hparams(w):
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)


def make_bpe(kind, out, seed, bad_ids=False):
    rng = random.Random(seed)
    enc = byte_chars()
    text = TRAIN * 3
    # Crude word split (the merges only need to exist; the pre-tokenizer is what is tested).
    words = []
    cur = ""
    for ch in text:
        if ch.isspace() and cur:
            words.append(cur)
            cur = ""
        cur += ch
    words.append(cur)
    words += ["".join(rng.choice("abcdefghij ") for _ in range(rng.randint(2, 8))) for _ in range(300)]
    bwords = ["".join(enc[b] for b in w.encode()) for w in words]
    merges = train_bpe(bwords, 400 + rng.randint(0, 100))
    tokens = []
    types = []
    first = ["<|begin_of_text|>"] if kind == "llama-bpe" else []
    for s in first + SPECIALS_BPE:
        tokens.append(s)
        types.append(gguf.TokenType.CONTROL)
    # A user-defined token: llama.cpp matches it whole even when specials are not parsed.
    tokens.append("<tool>")
    types.append(gguf.TokenType.USER_DEFINED)
    # A normal-typed FIM token: llama.cpp recognises it by its text and makes it control.
    tokens.append("<|fim_prefix|>")
    types.append(gguf.TokenType.NORMAL)
    byte_toks = [enc[b] for b in range(256)]
    rng.shuffle(byte_toks)
    for t in byte_toks:
        tokens.append(t)
        types.append(gguf.TokenType.NORMAL)
    seen = set(tokens)
    for a, b in merges:
        if a + b not in seen:
            seen.add(a + b)
            tokens.append(a + b)
            types.append(gguf.TokenType.NORMAL)
    # Whole words that no merge sequence reaches: llama-bpe takes them whole (ignore_merges),
    # qwen2 never produces them.
    for word in WHOLE_WORDS:
        t = "".join(enc[b] for b in word.encode())
        if t not in seen:
            seen.add(t)
            tokens.append(t)
            types.append(gguf.TokenType.NORMAL)
    w = gguf.GGUFWriter(out, "llama")
    hparams(w)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(kind)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    if kind == "llama-bpe":
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
        # add_bos_token left out: llama-bpe's default (true) applies.
    elif bad_ids:
        # Out of range: llama.cpp keeps the BPE default EOS (11) and disables EOT.
        w.add_bos_token_id(0)
        w.add_eos_token_id(len(tokens) + 100)
        w.add_eot_token_id(0xFFFFFFFF)
        w.add_pad_token_id(len(tokens))
        w.add_add_bos_token(False)
    else:
        w.add_bos_token_id(0)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_spm(out, seed, bad_ids=False):
    rng = random.Random(seed)
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    scores = [0.0, 0.0, 0.0]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(gguf.TokenType.BYTE)
        scores.append(0.0)
    for s, t in [("<|im_start|>", gguf.TokenType.CONTROL), ("<|im_end|>", gguf.TokenType.CONTROL),
                 ("<tool>", gguf.TokenType.USER_DEFINED)]:
        tokens.append(s)
        types.append(t)
        scores.append(0.0)
    seen = set(tokens)
    text = TRAIN.replace(" ", "\u2581")
    pieces = []
    # Every character of the training text (not all: some are left to byte fallback).
    for ch in sorted(set(text)):
        if ch != "\n" and rng.random() < 0.9:
            pieces.append(ch)
    for _ in range(1500):
        i = rng.randrange(len(text))
        n = rng.randint(2, 7)
        p = text[i:i + n]
        if "\n" not in p:
            pieces.append(p)
    for p in pieces:
        if p not in seen:
            seen.add(p)
            tokens.append(p)
            types.append(gguf.TokenType.NORMAL)
            # Scores: longer pieces tend to win, with seeded noise and some exact ties.
            scores.append(round(-10.0 + len(p) + rng.uniform(-3, 3), 1))
    w = gguf.GGUFWriter(out, "llama")
    hparams(w)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    if bad_ids:
        # Out of range: llama.cpp keeps the SentencePiece default EOS (2), disables EOT.
        w.add_eos_token_id(0xFFFFFFFF)
        w.add_eot_token_id(len(tokens) + 5)
        w.add_pad_token_id(len(tokens))
    else:
        w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def reference(model_path):
    import llama_cpp

    req = json.load(sys.stdin)
    llm = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)

    def piece(tok):
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(vocab, tok, buf, 256, 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(vocab, tok, buf, -n, 0, True)
        return buf.raw[:n]

    def detok(ids):
        arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
        size = 64 + 16 * len(ids)
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, True)
        if n < 0:
            size = -n
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, True)
        return buf.raw[:n]

    tokens = []
    dts = []
    for c in req["cases"]:
        ids = llm.tokenize(c["text"].encode(), add_bos=c["add_special"], special=c["parse_special"])
        tokens.append(ids)
        dts.append(detok(ids).hex())
    ans = {
        "tokens": tokens,
        "detok": dts,
        "pieces": [piece(i).hex() for i in range(n_vocab)],
        "eog": [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)],
        "bos": llama_cpp.llama_vocab_bos(vocab),
        "eos": llama_cpp.llama_vocab_eos(vocab),
        "n_vocab": n_vocab,
    }
    json.dump(ans, sys.stdout)


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "make-vocab":
        kind, out, seed = sys.argv[2], sys.argv[3], int(sys.argv[4])
        bad_ids = kind.endswith("+bad-ids")
        kind = kind.removesuffix("+bad-ids")
        if kind == "spm":
            make_spm(out, seed, bad_ids)
        elif kind in ("qwen2", "llama-bpe", "default", "gpt-2", "starcoder"):
            make_bpe(kind, out, seed, bad_ids)
        else:
            sys.exit(f"unknown vocabulary kind {kind!r}")
    elif len(sys.argv) == 3 and sys.argv[1] == "reference":
        reference(sys.argv[2])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
