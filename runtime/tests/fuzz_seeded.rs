//! The fuzz targets of `runtime/fuzz` (`serve_request`, `chat_template`), run on stable as a
//! short seeded fuzz: each target's own body (`kiln_runtime::fuzzing`) over its seed corpus
//! (`fuzz/seeds/<target>/`, with every crash the fuzzer found kept there as a regression case)
//! and a fixed number of deterministic mutations of it (fixed seed, the target's dictionary).
//! The long runs (10^7 inputs each) are cargo-fuzz's, outside CI: docs/testing.md, "Fuzzing".

use kiln_runtime::fuzzing;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

fn seeds(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = fuzz_dir().join("seeds").join(target);
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            let p = e.expect("a seed").path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).expect("reading a seed"))
        })
        .collect();
    v.sort();
    assert!(v.len() >= 5, "{}: too few seeds", dir.display());
    v
}

/// A libFuzzer dictionary's tokens (`name="..."`, `\xNN` and `\\` `\"` escapes).
fn dictionary(target: &str) -> Vec<Vec<u8>> {
    let p = fuzz_dir().join("dict").join(format!("{target}.dict"));
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let q = &l[l.find('"').expect("a quoted token") + 1..l.len() - 1];
            let (mut out, b) = (Vec::new(), q.as_bytes());
            let mut i = 0;
            while i < b.len() {
                match (b[i], b.get(i + 1)) {
                    (b'\\', Some(b'x')) => {
                        out.push(u8::from_str_radix(&q[i + 2..i + 4], 16).expect("\\xNN"));
                        i += 4;
                    }
                    (b'\\', Some(&c)) => {
                        out.push(c);
                        i += 2;
                    }
                    (c, _) => {
                        out.push(c);
                        i += 1;
                    }
                }
            }
            out
        })
        .collect()
}

/// The seeds, then `n` mutations of them (round robin over the seeds, one SplitMix64 stream).
fn inputs(target: &str, n: usize) -> Vec<(String, Vec<u8>)> {
    let seeds = seeds(target);
    let dict = dictionary(target);
    let dict: Vec<&[u8]> = dict.iter().map(Vec::as_slice).collect();
    let mut rng = 0x6b69_6c6e_u64; // "kiln"
    let mut all = seeds.clone();
    for i in 0..n {
        let (name, s) = &seeds[i % seeds.len()];
        all.push((
            format!("mutation {i} of {name}"),
            fuzzing::mutate(s, &dict, &mut rng),
        ));
    }
    all
}

/// Runs `body` over `inputs` on a thread of its own; an input that panics, or takes longer than
/// `limit`, fails the test naming it.
fn run_all(inputs: Vec<(String, Vec<u8>)>, limit: Duration, body: fn(&[u8])) {
    let (tx, rx) = mpsc::channel::<usize>();
    let names: Vec<String> = inputs.iter().map(|(n, _)| n.clone()).collect();
    let worker = std::thread::spawn(move || {
        for (i, (_, data)) in inputs.iter().enumerate() {
            let _ = tx.send(i);
            body(data);
        }
    });
    let mut current = None;
    loop {
        match rx.recv_timeout(limit) {
            Ok(i) => current = Some(i),
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => panic!(
                "{:?} has run for over {limit:?}",
                current.map(|i| &names[i])
            ),
        }
    }
    if worker.join().is_err() {
        panic!(
            "{:?} broke an invariant (its panic above)",
            current.map(|i| &names[i])
        );
    }
}

#[test]
fn chat_template_seeded() {
    run_all(
        inputs("chat_template", 2000),
        Duration::from_secs(10),
        fuzzing::chat_template::run,
    );
}

#[test]
fn serve_request_seeded() {
    run_all(
        inputs("serve_request", 2000),
        Duration::from_secs(20),
        fuzzing::serve_request::run,
    );
}
