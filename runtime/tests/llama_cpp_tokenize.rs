//! kiln's tokenizer against llama.cpp itself (llama-cpp-python 0.3.36, which compiles llama.cpp
//! from source): token ids, detokenised bytes, every token's piece, the end-of-generation set,
//! BOS/EOS, on SmolLM2 and on synthetic seeded vocabularies written with gguf-py (SentencePiece
//! `llama` with byte fallback and scores; byte-level `gpt2` with pre `qwen2`, `llama-bpe`,
//! `default`, `gpt-2`, `starcoder`),
//! over a corpus of prose, numbers, code, whitespace runs, Unicode and special tokens, with and
//! without add_special and parse_special.
//!
//! `cargo xtask test --stage llama-cpp` prepares the venv and the model and names them in
//! `KILN_LLAMA_PY` and `KILN_SMOLLM2`; run with `--ignored` but without them, these fail.

mod support;

use kiln_runtime::gguf::GgufFile;
use kiln_runtime::tokenizer::Tokenizer;
use serde_json::{json, Value as J};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn env_path(var: &str) -> PathBuf {
    match std::env::var_os(var) {
        Some(p) => PathBuf::from(p),
        None => panic!(
            "{var} is not set: this test compares kiln with llama.cpp (llama-cpp-python), which \
             `cargo xtask test --stage llama-cpp` installs and names in {var}"
        ),
    }
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/llama_cpp_tokenize.py")
}

fn python() -> Command {
    let mut c = Command::new(env_path("KILN_LLAMA_PY"));
    c.arg(script());
    c
}

fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A synthetic vocabulary written by gguf-py.
fn make_vocab(kind: &str, seed: u64, dir: &Path) -> PathBuf {
    let out = dir.join(format!("{kind}-{seed}.gguf"));
    let st = python()
        .args(["make-vocab", kind])
        .arg(&out)
        .arg(seed.to_string())
        .status()
        .expect("running the llama.cpp python helper");
    assert!(st.success(), "make-vocab {kind} {seed} failed");
    out
}

struct Case {
    text: String,
    add_special: bool,
    parse_special: bool,
}

/// llama.cpp's answers for these cases on this model.
fn reference(model: &Path, cases: &[Case]) -> J {
    let req = json!({
        "cases": cases.iter().map(|c| json!({
            "text": c.text, "add_special": c.add_special, "parse_special": c.parse_special
        })).collect::<Vec<_>>()
    });
    let mut child = python()
        .arg("reference")
        .arg(model)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running the llama.cpp python helper");
    let body = serde_json::to_vec(&req).unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || {
        use std::io::Write as _;
        stdin.write_all(&body).unwrap();
    });
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    assert!(
        out.status.success(),
        "llama.cpp reference failed on {}: {}",
        model.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("reference JSON")
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn ids(j: &J) -> Vec<u32> {
    j.as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

/// Small pieces that stress the pre-tokenizers and the merges, joined at random.
const PIECES: &[&str] = &[
    "hello",
    "Hello",
    "HELLO",
    " world",
    "the",
    " the",
    "'s",
    "'S",
    "'ll",
    "'re",
    "'VE",
    "'d",
    "'x",
    " ",
    "  ",
    "   ",
    "\t",
    "\t\t",
    "\n",
    "\n\n",
    "\r\n",
    " \n",
    "\n ",
    "\u{a0}",
    "\u{3000}",
    "\u{85}",
    "\u{2028}",
    "0",
    "7",
    "42",
    "123",
    "2024",
    "4567890123",
    "3.14",
    "1,000",
    "-5",
    "0x1F",
    ".",
    ",",
    "?",
    "!",
    "...",
    "?!",
    "(",
    ")",
    "{",
    "}",
    "[",
    "]",
    "$",
    "+=",
    "->",
    "=>",
    "::",
    "//",
    "#",
    "@",
    "_",
    "`",
    "~",
    "^",
    "|",
    "\\",
    "\"",
    "é",
    "ñ",
    "Straße",
    "naïve",
    "中文",
    "日本語",
    "한국어",
    "Ελληνικά",
    "текст",
    "😀",
    "🎉",
    "👍🏽",
    "e\u{301}",
    "a\u{308}",
    "\u{301}",
    "\u{200b}",
    "\u{fffd}",
    "\u{feff}",
    "١٢٣",
    "Ⅻ",
    "½",
    "ǅ",
    "ʰ",
    "\u{378}",
    "\u{e000}",
    "\u{10ffff}",
    "▁",
    "▁x",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<tool>",
    "<|fim_prefix|>",
    "<s>",
    "</s>",
    "<unk>",
    "<|im_start",
    "<",
    "|>",
    "def",
    " f(x):",
    "    return",
    "x\n",
    "fn main() {}",
];

const FIXED: &[&str] = &[
    "",
    " ",
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's isn't, they'll, we've, I'd, you're.",
    "Numbers: 0 1 12 123 1234 12345 123456789012345 3.14159 1,000,000 2024-10-11 0xDEADBEEF",
    "def main(argv):\n    for i in range(10):\n        print(f\"{i}: {argv[i]!r}\")\n\treturn 0\n",
    "    leading spaces and trailing spaces    ",
    "\n\n\n",
    " \t \n \r\n\t\t  x  \n\n  y",
    "Café naïve résumé façade Straße Übermut Ærøskøbing",
    "日本語のテキスト 中文文本 한국어 텍스트 Русский текст Ελληνικά العربية",
    "emoji 😀🎉👍🏽👨‍👩‍👧 flags 🇫🇷 and combining e\u{301} a\u{308} o\u{302}\u{323}",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|><|endoftext|><tool><|fim_prefix|><s></s><unk>",
    "text<tool>more<tool> <tool>",
    "\u{fffd}\u{feff}\u{200b}\u{2028}\u{85}\u{a0}\u{3000}",
    "'''s 's's 'S 'LL 'Re",
    "a  b   c    d",
    "$x += y->z; // comment\n#include <stdio.h>\nint main(void) { return 0; }",
];

/// The corpus: fixed texts, then `n` seeded random joins of `PIECES`.
fn corpus(seed: u64, n: usize) -> Vec<String> {
    let mut out: Vec<String> = FIXED.iter().map(|s| s.to_string()).collect();
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..n {
        let k = 1 + (next() % 12) as usize;
        let s: String = (0..k)
            .map(|_| PIECES[(next() % PIECES.len() as u64) as usize])
            .collect();
        out.push(s);
    }
    out
}

fn cases(texts: &[String]) -> Vec<Case> {
    let mut v = Vec::new();
    for t in texts {
        for (add_special, parse_special) in
            [(true, true), (false, false), (true, false), (false, true)]
        {
            v.push(Case {
                text: t.clone(),
                add_special,
                parse_special,
            });
        }
    }
    v
}

/// Everything kiln and llama.cpp should agree on for one model; returns the number of cases.
fn compare(model: &Path, texts: &[String]) -> usize {
    let f = GgufFile::open(model).unwrap();
    let tok = Tokenizer::from_gguf(f.gguf()).unwrap();
    let cases = cases(texts);
    let r = reference(model, &cases);
    let name = model.display();

    assert_eq!(
        tok.n_vocab() as u64,
        r["n_vocab"].as_u64().unwrap(),
        "{name}: n_vocab"
    );
    let as_id = |j: &J| u32::try_from(j.as_i64().unwrap()).ok();
    assert_eq!(tok.bos(), as_id(&r["bos"]), "{name}: bos");
    assert_eq!(tok.eos(), as_id(&r["eos"]), "{name}: eos");
    let eog: Vec<u32> = tok.eog_ids().collect();
    assert_eq!(eog, ids(&r["eog"]), "{name}: end-of-generation tokens");

    let pieces = r["pieces"].as_array().unwrap();
    let bad_pieces: Vec<u32> = (0..tok.n_vocab() as u32)
        .filter(|&i| tok.token_to_piece(i) != hex(pieces[i as usize].as_str().unwrap()))
        .collect();
    assert!(
        bad_pieces.is_empty(),
        "{name}: token_to_piece differs for ids {bad_pieces:?}"
    );

    let mut failures = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        let want = ids(&r["tokens"][i]);
        let got = tok.encode(&c.text, c.add_special, c.parse_special).unwrap();
        if got != want {
            failures.push(format!(
                "encode({:?}, add_special={}, parse_special={}):\n  kiln      {got:?}\n  llama.cpp {want:?}",
                c.text, c.add_special, c.parse_special
            ));
        }
        let want_text = hex(r["detok"][i].as_str().unwrap());
        let got_text = tok.decode(&want);
        if got_text != want_text {
            failures.push(format!(
                "decode({want:?}) of {:?}:\n  kiln      {:?}\n  llama.cpp {:?}",
                c.text,
                String::from_utf8_lossy(&got_text),
                String::from_utf8_lossy(&want_text)
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{name}: {} of {} cases differ from llama.cpp; first ones:\n{}",
        failures.len(),
        cases.len(),
        failures
            .iter()
            .take(8)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    println!("{name}: {} cases equal to llama.cpp", cases.len());
    cases.len()
}

#[test]
#[ignore = "needs llama-cpp-python and SmolLM2: cargo xtask test --stage llama-cpp"]
fn llama_cpp_tokenize_smollm2() {
    let model = env_path("KILN_SMOLLM2");
    compare(&model, &corpus(1, 400));
}

#[test]
#[ignore = "needs llama-cpp-python: cargo xtask test --stage llama-cpp"]
fn llama_cpp_tokenize_synthetic_spm() {
    let dir = scratch("llama_cpp_tokenize_spm");
    for seed in [7, 8] {
        compare(&make_vocab("spm", seed, &dir), &corpus(seed, 300));
    }
}

#[test]
#[ignore = "needs llama-cpp-python: cargo xtask test --stage llama-cpp"]
fn llama_cpp_tokenize_synthetic_qwen2() {
    let dir = scratch("llama_cpp_tokenize_qwen2");
    for seed in [7, 8] {
        compare(&make_vocab("qwen2", seed, &dir), &corpus(seed, 300));
    }
}

#[test]
#[ignore = "needs llama-cpp-python: cargo xtask test --stage llama-cpp"]
fn llama_cpp_tokenize_synthetic_llama_bpe() {
    let dir = scratch("llama_cpp_tokenize_llama_bpe");
    for seed in [7, 8] {
        compare(&make_vocab("llama-bpe", seed, &dir), &corpus(seed, 300));
    }
}

/// Special-token ids outside the vocabulary (EOS, EOT, padding): kiln keeps what llama.cpp keeps
/// (the model's default EOS, no EOT), so BOS, EOS and the end-of-generation set equal llama.cpp's,
/// and the load names each key with its value in `Tokenizer::warnings` (printed on stderr).
#[test]
#[ignore = "needs llama-cpp-python: cargo xtask test --stage llama-cpp"]
fn llama_cpp_tokenize_out_of_range_special_ids() {
    let dir = scratch("llama_cpp_tokenize_bad_ids");
    for (kind, eos) in [("spm+bad-ids", 2), ("qwen2+bad-ids", 11)] {
        let model = make_vocab(kind, 7, &dir);
        compare(&model, &corpus(7, 100));
        let f = GgufFile::open(&model).unwrap();
        let tok = Tokenizer::from_gguf(f.gguf()).unwrap();
        assert_eq!(tok.eos(), Some(eos), "{kind}: the default EOS");
        let w = tok.warnings().join("\n");
        for key in [
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.padding_token_id",
        ] {
            assert!(
                w.contains(&format!("{key} = ")) && w.contains("outside the vocabulary"),
                "{kind}: no warning naming {key}: {w}"
            );
        }
    }
}

/// The other byte-level pre-tokenizers kiln implements: `default` (four expressions, three of
/// them through llama.cpp's std::regex path), `gpt-2`, `starcoder` (smollm's split with space
/// clean-up on decode).
#[test]
#[ignore = "needs llama-cpp-python: cargo xtask test --stage llama-cpp"]
fn llama_cpp_tokenize_synthetic_default_gpt2_starcoder() {
    let dir = scratch("llama_cpp_tokenize_other_pre");
    for kind in ["default", "gpt-2", "starcoder"] {
        compare(&make_vocab(kind, 9, &dir), &corpus(9, 300));
    }
}

/// `kiln tokenize --json` prints llama.cpp's ids (add_bos per the file, specials parsed).
#[test]
#[ignore = "needs llama-cpp-python and SmolLM2: cargo xtask test --stage llama-cpp"]
fn llama_cpp_tokenize_cli() {
    let model = env_path("KILN_SMOLLM2");
    let text = FIXED[12];
    let want = reference(
        &model,
        &[Case {
            text: text.to_string(),
            add_special: true,
            parse_special: true,
        }],
    );
    let out = support::kiln_cmd()
        .arg("tokenize")
        .arg(&model)
        .args(["--text", text, "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: J = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got["tokens"], want["tokens"][0]);
}
