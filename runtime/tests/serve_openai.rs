//! `kiln serve` against the official `openai` Python client (`tests/py/serve_openai.py`): every
//! endpoint, streamed and not, the errors, 8 concurrent clients each getting the tokens
//! `kiln run --temp 0` gives alone, and a fuzz of mutated bodies and raw byte streams. The
//! `serve` stage of `cargo xtask test` passes `KILN_OPENAI_PY` (a venv with the pinned client)
//! and `KILN_SMOLLM2`.

#[test]
#[ignore = "needs the openai client (KILN_OPENAI_PY) and KILN_SMOLLM2; run by the serve stage"]
fn serve_answers_the_openai_client() {
    let py = std::env::var("KILN_OPENAI_PY").expect("KILN_OPENAI_PY");
    let model = std::env::var("KILN_SMOLLM2").expect("KILN_SMOLLM2");
    let work = tempfile::tempdir().expect("tempdir");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/py/serve_openai.py");
    let st = std::process::Command::new(py)
        .args([script, env!("CARGO_BIN_EXE_kiln"), &model])
        .arg(work.path())
        .status()
        .expect("running serve_openai.py");
    assert!(st.success(), "serve_openai.py failed: {st}");
}
