"""llama.cpp's side of runtime/tests/llama_cpp_model.rs.

  synth --arch A --wtype T --seed S --out F [--rope llama3 [--alter ...]]
      write a seeded synthetic model with gguf-py
  logits --model F --ids 1,2,3 --out F.f32 [--threads T] [--kv f16|f32] [--greedy N]
      evaluate the ids with llama.cpp (llama-cpp-python, Llama.eval; KV cache type and flash
      attention pinned), write per-position logits as raw little-endian f32 [n_ids, n_vocab] and
      print {"n_vocab", "greedy"} as JSON.
  tokenize --model F --text-file T    llama.cpp's token ids of the text, as JSON
  nll --model F --ids 1,2,3 [--tail N] [--greedy N]
      llama.cpp's mean NLL of the ids (each predicted from those before it, one context), of
      the last N of them, and greedy tokens after them, as JSON (no logits file: for a large
      vocabulary the logits of a long text are a gigabyte)
  chat --template-file T --messages-json M [--bos S] [--eos S]
      a conversation rendered by llama-cpp-python's Jinja2ChatFormatter (jinja2), by jinja2 set
      up as Hugging Face's apply_chat_template sets it up, and by llama.cpp's own
      llama_chat_apply_template, as JSON
  add-rope-freqs --model F --out G [--orig-ctx N]    F plus Llama 3's rope_freqs.weight
"""

import argparse
import json
import sys

import numpy as np


def quantize_q4_k(x):
    """A plain Q4_K quantiser (gguf-py only dequantises K-quants): per 32-value sub-block,
    min and scale from its range, both as 6-bit multiples of the super-block's dmin and d."""
    n, k = x.shape
    sb = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(sb.min(axis=2), 0.0)
    scale = (sb.max(axis=2) - lo) / 15.0
    d = np.maximum(scale.max(axis=1), 1e-8) / 63.0
    dmin = np.maximum((-lo).max(axis=1), 1e-8) / 63.0
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    df, dminf = d16.astype(np.float32), dmin16.astype(np.float32)
    sc = np.clip(np.rint(scale / df[:, None]), 1, 63).astype(np.int32)
    m = np.clip(np.rint(-lo / dminf[:, None]), 0, 63).astype(np.int32)
    eff_d = df[:, None] * sc
    eff_m = dminf[:, None] * m
    q = np.clip(np.rint((sb + eff_m[:, :, None]) / eff_d[:, :, None]), 0, 15).astype(np.uint8)
    nb = sb.shape[0]
    scales = np.zeros((nb, 12), dtype=np.uint8)
    for j in range(4):
        scales[:, j] = sc[:, j] & 63
        scales[:, j + 4] = m[:, j] & 63
    for j in range(4, 8):
        scales[:, j + 4] = (sc[:, j] & 0xF) | ((m[:, j] & 0xF) << 4)
        scales[:, j - 4] |= ((sc[:, j] >> 4) << 6).astype(np.uint8)
        scales[:, j] |= ((m[:, j] >> 4) << 6).astype(np.uint8)
    qs = np.zeros((nb, 128), dtype=np.uint8)
    for c in range(4):
        qs[:, 32 * c:32 * c + 32] = q[:, 2 * c, :] | (q[:, 2 * c + 1, :] << 4)
    blk = np.concatenate(
        [d16.view(np.uint8).reshape(nb, 2), dmin16.view(np.uint8).reshape(nb, 2), scales, qs],
        axis=1,
    )
    return blk.reshape(n, k // 256 * 144)


def synth(args):
    import gguf
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(args.seed)
    arch = args.arch
    # Shapes: K of every matmul a multiple of 256 (Q4_K super-blocks).
    if arch == "qwen3":
        # key_length (64) != embedding_length / head_count (256 / 8 = 32); GQA 8/4.
        n_embd, n_head, n_kv, head_dim, n_ff = 256, 8, 4, 64, 512
    elif arch == "gemma3":
        # key_length (128) != 256 / 4; GQA 4/2.
        n_embd, n_head, n_kv, head_dim, n_ff = 256, 4, 2, 128, 512
    elif arch == "phi3":
        n_embd, n_head, n_kv, head_dim, n_ff = 256, 4, 2, 64, 512
    elif arch == "qwen2":
        n_embd, n_head, n_kv, head_dim, n_ff = 256, 4, 2, 64, 512
    else:
        n_embd, n_head, n_kv, head_dim, n_ff = 256, 4, 1, 64, 512
    n_layer, n_vocab, n_ctx = 2, 384, 256
    if arch == "gemma3":
        n_layer = 6
    if args.shape:
        n_embd, n_head, n_kv, head_dim, n_ff = 576, 9, 3, 64, 1536
        n_layer = args.shape
    wtype = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q4_k": Q.Q4_K}[args.wtype]

    w = gguf.GGUFWriter(args.out, arch)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(1e-6 if arch != "llama" else 1e-5)
    w.add_rope_freq_base(10000.0 if arch == "llama" else 1000000.0)
    if arch == "gemma3":
        # Gemma 3's pieces, each set away from its default so that reading it shows: a window
        # of 8 (the sequences are 48 long), every third layer global (llama.cpp's default is
        # 6), windowed layers' RoPE base 20000 (default 10000), linear RoPE scaling x2 (global
        # layers only, as Gemma 3 4B+ has x8), and a final logit soft-cap of 5.
        w.add_sliding_window(8)
        w.add_sliding_window_pattern(3)
        w.add_rope_freq_base_swa(20000.0)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(2.0)
        w.add_final_logit_softcapping(5.0)
    if arch == "phi3":
        # Read and then switched off by llama.cpp's phi3 ("Phi SWA is currently disabled"): a
        # window shorter than the sequences, so that applying it would show.
        w.add_sliding_window(16)
    if arch in ("qwen3", "gemma3") or args.key_length:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if args.rope == "llama3":
        # Llama 3.x style: the "llama3" rope type baked into rope_freqs.weight by llama.cpp's
        # converter (conversion/llama.py generate_extra_tensors, same formula), for this file's
        # shapes: factor 8, low/high frequency factors 1 and 4, an original context of 64 (the
        # file's context is 256), so the 32 factors mix 1, 8 and the smooth ramp between. And
        # rope.scaling keys on top: linear, factor 2 (freq_scale 1/2), original context 64.
        old_ctx = 64
        factors = llama3_factors(10000.0, head_dim, old_ctx)
        if args.alter == "factors-ones":
            factors = np.ones_like(factors)
        w.add_tensor("rope_freqs.weight", factors)
        if args.alter != "no-scaling":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(2.0)
            w.add_rope_scaling_orig_ctx_len(old_ctx)
    # A SentencePiece vocabulary llama.cpp accepts: <unk> <s> </s>, the 256 byte tokens, fillers.
    toks, scores, types = ["<unk>", "<s>", "</s>"], [0.0, 0.0, 0.0], [2, 3, 3]
    for b in range(256):
        toks.append("<0x%02X>" % b)
        scores.append(0.0)
        types.append(6)
    while len(toks) < n_vocab:
        toks.append("t%d" % len(toks))
        scores.append(-float(len(toks)))
        types.append(1)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)

    def mat(name, k, n, ty=wtype):
        x = rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k)
        if ty == Q.Q4_K:
            w.add_tensor(name, quantize_q4_k(x), raw_dtype=Q.Q4_K)
        elif ty == Q.F32:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, ty), raw_dtype=ty)

    def vec(name, n, around=1.0, spread=0.2):
        w.add_tensor(name, (around + spread * rng.standard_normal(n)).astype(np.float32))

    # token_embd doubles as the LM head when output.weight is absent (qwen2/qwen3 here).
    # Scaled so that the tied head gives logits of a few units: peaked enough to have a clear
    # top-1, flat enough that KL sees small differences.
    emb = (rng.standard_normal((n_vocab, n_embd)) * 3.0 / np.sqrt(n_embd)).astype(np.float32)
    if arch == "llama":
        w.add_tensor("token_embd.weight", gguf.quants.quantize(emb, Q.Q8_0), raw_dtype=Q.Q8_0)
    elif wtype == Q.Q4_K:
        mat("token_embd.weight", n_embd, n_vocab)
    else:
        w.add_tensor("token_embd.weight", gguf.quants.quantize(emb, wtype), raw_dtype=wtype)
    vec("output_norm.weight", n_embd)
    if arch in ("llama", "phi3"):
        mat("output.weight", n_embd, n_vocab)
    qd, kvd = n_head * head_dim, n_kv * head_dim
    for l in range(n_layer):
        p = "blk.%d." % l
        vec(p + "attn_norm.weight", n_embd)
        if arch == "phi3":
            # Fused as Phi-3 ships them: rows [q | k | v], and [gate | up] below.
            mat(p + "attn_qkv.weight", n_embd, qd + 2 * kvd)
        else:
            mat(p + "attn_q.weight", n_embd, qd)
            mat(p + "attn_k.weight", n_embd, kvd)
            mat(p + "attn_v.weight", n_embd, kvd)
        if arch == "qwen2":
            vec(p + "attn_q.bias", qd, 0.0, 0.5)
            vec(p + "attn_k.bias", kvd, 0.0, 0.5)
            vec(p + "attn_v.bias", kvd, 0.0, 0.5)
        if arch in ("qwen3", "gemma3"):
            vec(p + "attn_q_norm.weight", head_dim)
            vec(p + "attn_k_norm.weight", head_dim)
        if arch == "gemma3":
            vec(p + "post_attention_norm.weight", n_embd)
            vec(p + "post_ffw_norm.weight", n_embd)
        mat(p + "attn_output.weight", qd, n_embd)
        vec(p + "ffn_norm.weight", n_embd)
        if arch == "phi3":
            mat(p + "ffn_up.weight", n_embd, 2 * n_ff)
        else:
            mat(p + "ffn_gate.weight", n_embd, n_ff)
            mat(p + "ffn_up.weight", n_embd, n_ff)
        mat(p + "ffn_down.weight", n_ff, n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama3_factors(base, dim, old_ctx, factor=8.0, low=1.0, high=4.0):
    """Llama 3's rope factors, as llama.cpp's converter computes them (conversion/llama.py)."""
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def add_rope_freqs(args):
    """A copy of a llama GGUF with a rope_freqs.weight tensor added (every key and tensor kept, as
    gguf-py's gguf_new_metadata copies them): Llama 3's factors for the file's head dimension and
    RoPE base, with an original context of --orig-ctx."""
    import gguf

    r = gguf.GGUFReader(args.model)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(args.out, arch)
    for field in r.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vt = field.types[0]
        st = field.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vt, sub_type=st)
    base = r.fields[arch + ".rope.freq_base"].contents()
    dim = r.fields[arch + ".rope.dimension_count"].contents()
    factors = llama3_factors(base, dim, args.orig_ctx)
    for t in r.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.add_tensor_info("rope_freqs.weight", factors.shape, factors.dtype, factors.nbytes,
                      gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in r.tensors:
        w.write_tensor_data(t.data, tensor_endianess=r.endianess)
    w.write_tensor_data(factors)
    w.close()


def top2(row):
    """The argmax of a logit row (the first on equal values, as np.argmax) and the runner-up."""
    t = int(np.argmax(row))
    rest = row.copy()
    rest[t] = -np.inf
    return t, int(np.argmax(rest))


def logits(args):
    import llama_cpp

    ids = [int(t) for t in args.ids.split(",") if t.strip()]
    ty = {"f16": 1, "f32": 0}[args.kv]
    n_ctx = len(ids) + args.greedy + 8
    llm = llama_cpp.Llama(
        model_path=args.model,
        n_ctx=n_ctx,
        n_batch=512,
        n_ubatch=512,
        logits_all=True,
        type_k=ty,
        type_v=ty,
        flash_attn=False,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_gpu_layers=0,
        verbose=False,
    )
    llm.eval(ids)
    n_vocab = llm.n_vocab()
    out = np.array(llm.scores[: len(ids), :n_vocab], dtype="<f4")
    out.tofile(args.out)
    greedy, gaps, seconds = [], [], []
    for _ in range(args.greedy):
        row = np.array(llm.scores[llm.n_tokens - 1, :n_vocab], dtype=np.float64)
        t, second = top2(row)
        greedy.append(t)
        seconds.append(second)
        gaps.append(float(row[t] - row[second]))
        llm.eval([t])
    json.dump({"n_vocab": n_vocab, "greedy": greedy, "gaps": gaps, "seconds": seconds}, sys.stdout)
    print()


def tokenize(args):
    """llama.cpp's token ids of a text (BOS as the file says, specials parsed), as JSON."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=args.model, vocab_only=True, verbose=False)
    text = open(args.text_file, encoding="utf-8").read()
    json.dump(llm.tokenize(text.encode("utf-8"), add_bos=True, special=True), sys.stdout)
    print()


def nll(args):
    """Mean NLL of the ids in one context (f16 KV, no flash attention, as `logits`), computed
    here row by row, and greedy tokens after them with llama.cpp's top-2 gaps."""
    import llama_cpp

    ids = [int(t) for t in args.ids.split(",") if t.strip()]
    llm = llama_cpp.Llama(
        model_path=args.model,
        n_ctx=len(ids) + args.greedy + 8,
        n_batch=512,
        n_ubatch=512,
        logits_all=True,
        type_k=1,
        type_v=1,
        flash_attn=False,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_gpu_layers=0,
        verbose=False,
    )
    llm.eval(ids)
    n_vocab = llm.n_vocab()
    per = []
    for i in range(len(ids) - 1):
        row = np.asarray(llm.scores[i, :n_vocab], dtype=np.float64)
        m = row.max()
        per.append(float(np.log(np.exp(row - m).sum()) + m - row[ids[i + 1]]))
    greedy, gaps, seconds = [], [], []
    for _ in range(args.greedy):
        row = np.array(llm.scores[llm.n_tokens - 1, :n_vocab], dtype=np.float64)
        t, second = top2(row)
        greedy.append(t)
        seconds.append(second)
        gaps.append(float(row[t] - row[second]))
        llm.eval([t])
    tail = per[-args.tail:] if args.tail else per
    json.dump(
        {
            "n_vocab": n_vocab,
            "nll": sum(per) / len(per),
            "nll_tail": sum(tail) / len(tail),
            "greedy": greedy,
            "gaps": gaps,
            "seconds": seconds,
        },
        sys.stdout,
    )
    print()


def hf_render(template, messages, bos, eos):
    """jinja2 itself, set up as Hugging Face's apply_chat_template sets it up (sandboxed,
    trim_blocks and lstrip_blocks, raise_exception, strftime_now) and called as it calls it for a chat without
    tools (no `tools` variable at all), with the generation prompt."""
    import datetime

    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def strftime_now(fmt):
        # Hugging Face formats the local time; kiln (and the board, TZ=UTC) the UTC time.
        return datetime.datetime.now(datetime.timezone.utc).strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template).render(
        messages=messages, bos_token=bos, eos_token=eos, add_generation_prompt=True
    )


def chat(args):
    """A conversation through llama-cpp-python's Jinja2ChatFormatter (jinja2) and through
    llama.cpp's C API llama_chat_apply_template with the same template text."""
    import ctypes

    import llama_cpp
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = open(args.template_file, encoding="utf-8").read()
    messages = json.load(open(args.messages_json, encoding="utf-8"))
    fmt = Jinja2ChatFormatter(template=template, eos_token=args.eos, bos_token=args.bos)
    try:
        jinja = fmt(messages=messages).prompt
    except Exception as e:  # e.g. `tools is defined` for the None the formatter passes
        jinja = None
        print("Jinja2ChatFormatter: %s: %s" % (type(e).__name__, e), file=sys.stderr)
    hf = hf_render(template, messages, args.bos, args.eos)
    arr = (llama_cpp.llama_chat_message * len(messages))()
    keep = []
    for i, m in enumerate(messages):
        role, content = m["role"].encode(), m["content"].encode()
        keep += [role, content]
        arr[i].role = role
        arr[i].content = content
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_chat_apply_template(template.encode(), arr, len(messages), True, buf, len(buf))
    native = buf.raw[:n].decode("utf-8") if n >= 0 else None
    json.dump({"jinja2": jinja, "hf_jinja2": hf, "llama_cpp": native}, sys.stdout)
    print()


def bench(args):
    """llama.cpp's prefill and decode tok/s for the same shape as `kiln bench` (f16 KV, no flash
    attention, ids spread over the vocabulary, greedy decode)."""
    import time

    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=args.model,
        n_ctx=args.p + args.n + 8,
        n_batch=512,
        n_ubatch=512,
        type_k=1,
        type_v=1,
        flash_attn=False,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_gpu_layers=0,
        verbose=False,
    )
    n_vocab = llm.n_vocab()
    ids = [(i * 7919 + 13) % n_vocab for i in range(args.p)]
    t0 = time.perf_counter()
    llm.eval(ids)
    prefill = time.perf_counter() - t0
    t1 = time.perf_counter()
    for i in range(args.n):
        llm.eval([(i * 31 + 7) % n_vocab])
    decode = time.perf_counter() - t1
    rss = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                rss[key] = int(value.split()[0])
    json.dump(
        {
            "prefill_tok_s": args.p / prefill,
            "decode_tok_s": args.n / decode,
            "rss_anon_kb": rss.get("RssAnon"),
            "rss_file_kb": rss.get("RssFile"),
        },
        sys.stdout,
    )
    print()


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("synth")
    s.add_argument("--arch", required=True, choices=["llama", "qwen2", "qwen3", "gemma3", "phi3"])
    s.add_argument("--wtype", required=True, choices=["q8_0", "q4_0", "q4_1", "q4_k"])
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--key-length", action="store_true")
    s.add_argument("--shape", type=int, default=0, help="SmolLM2's shapes with this many layers")
    s.add_argument("--rope", default="plain", choices=["plain", "llama3"],
                   help="llama3: rope_freqs.weight (Llama 3 factors) and linear rope.scaling keys")
    s.add_argument("--alter", default="none", choices=["none", "factors-ones", "no-scaling"],
                   help="with --rope llama3: the same file with the factors all 1.0, or without "
                        "the rope.scaling keys")
    s.add_argument("--out", required=True)
    g = sub.add_parser("logits")
    g.add_argument("--model", required=True)
    g.add_argument("--ids", required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--threads", type=int, default=2)
    g.add_argument("--kv", default="f16", choices=["f16", "f32"])
    g.add_argument("--greedy", type=int, default=0)
    rf = sub.add_parser("add-rope-freqs")
    rf.add_argument("--model", required=True)
    rf.add_argument("--out", required=True)
    rf.add_argument("--orig-ctx", type=int, default=64)
    t = sub.add_parser("tokenize")
    t.add_argument("--model", required=True)
    t.add_argument("--text-file", required=True)
    n = sub.add_parser("nll")
    n.add_argument("--model", required=True)
    n.add_argument("--ids", required=True)
    n.add_argument("--threads", type=int, default=2)
    n.add_argument("--tail", type=int, default=0)
    n.add_argument("--greedy", type=int, default=0)
    c = sub.add_parser("chat")
    c.add_argument("--template-file", required=True)
    c.add_argument("--messages-json", required=True)
    c.add_argument("--bos", default="<bos>")
    c.add_argument("--eos", default="<eos>")
    b = sub.add_parser("bench")
    b.add_argument("--model", required=True)
    b.add_argument("-p", type=int, default=128)
    b.add_argument("-n", type=int, default=64)
    b.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    {
        "synth": synth,
        "add-rope-freqs": add_rope_freqs,
        "logits": logits,
        "tokenize": tokenize,
        "nll": nll,
        "chat": chat,
        "bench": bench,
    }[a.cmd](a)


if __name__ == "__main__":
    main()
