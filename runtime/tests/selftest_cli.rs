//! The `kiln selftest` binary: exit code 0 only when nothing failed, the report on stdout between
//! the markers equals `report.json`, and `report.txt` is written next to it.

mod support;

use kiln_runtime::model::fixture;
use kiln_runtime::selftest::report::{Report, Verdict};
use kiln_runtime::selftest::{model_matmul, model_nll};
use std::path::Path;

fn write(root: &Path, rel: &str, bytes: &[u8]) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, bytes).unwrap();
}

fn selftest(root: &Path) -> (i32, String) {
    selftest_with(root, &[])
}

fn selftest_with(root: &Path, extra: &[&str]) -> (i32, String) {
    let out = support::kiln_cmd()
        .args(["selftest", "--board"])
        .arg(root.join("etc/kiln/board.toml"))
        .arg("--report-dir")
        .arg(root.join("boot/kiln"))
        .arg("--root")
        .arg(root)
        .args(extra)
        // No librknnrt here: the NPU checks skip (qemu-virt pins no NPU runtime in this test).
        .env("KILN_RKNN_LIB", root.join("no-such-librknnrt.so"))
        .env_remove("KILN_SELFTEST_INJECT")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
    )
}

#[test]
fn exit_code_console_and_files_agree() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    // Features that allow the kernel the CPU backend picks here (cpu.features checks both).
    let (features, pinned) = match kiln_runtime::backend::cpu::CpuBackend::new()
        .kernel()
        .name()
    {
        "neon+sdot" => ("fp asimd asimddp", "asimd"),
        "neon" => ("fp asimd", "asimd"),
        _ => ("fpu sse2", "sse2"),
    };
    write(
        root,
        "etc/kiln/board.toml",
        format!("[board]\nname = \"qemu-virt\"\nnpu = false\n[expect]\nkernel_release = \"6.1.192-kiln\"\ncpu_features = [\"{pinned}\"]\nkernel_config = [\"CONFIG_X=y\"]\n").as_bytes(),
    );
    write(root, "proc/sys/kernel/osrelease", b"6.1.192-kiln\n");
    write(
        root,
        "boot/config-6.1.192-kiln",
        b"# Linux/arm64 6.1.192 Kernel Configuration\nCONFIG_LOCALVERSION=\"-kiln\"\nCONFIG_X=y\n",
    );
    write(
        root,
        "proc/cpuinfo",
        format!("Features\t: {features}\n").as_bytes(),
    );
    write(root, "dev/kmsg", b"6,1,0,-;Linux version 6.1.192-kiln\n");
    // The CPUs `kiln selftest` may run on (it inherits this test's affinity), all alike.
    let online = kiln_runtime::cpus::format_list(&kiln_runtime::cpus::affinity().unwrap());
    write(
        root,
        "sys/devices/system/cpu/online",
        format!("{online}\n").as_bytes(),
    );
    let mut w = kiln_runtime::gguf::writer::GgufWriter::new();
    w.tensor_f32("w", &[32, 4], &[0.5; 128]).unwrap();
    let model = w.to_bytes();
    write(root, "models/m.gguf", &model);
    // The known answers the image build records: the weight's matmul answers and the seeded
    // llama fixture's NLL (model.matmul.* and model.nll.* fail on a board without them).
    let llama = fixture::gguf().unwrap();
    write(root, &format!("models/{}", fixture::FILE_NAME), &llama);
    let mut matmul = model_matmul::record(
        &root.join("models/m.gguf"),
        "m.gguf",
        model_matmul::DEFAULT_SEED,
    )
    .unwrap();
    matmul.extend(
        model_matmul::record(
            &root.join("models").join(fixture::FILE_NAME),
            fixture::FILE_NAME,
            model_matmul::DEFAULT_SEED,
        )
        .unwrap(),
    );
    let nll = model_nll::record(
        &root.join("models").join(fixture::FILE_NAME),
        fixture::FILE_NAME,
        "The kiln board reads this text at every boot.",
    )
    .unwrap();
    // What image.manifest compares: the binary that runs (proc/self/exe), the boot files, the
    // model, the command line.
    let kiln = env!("CARGO_BIN_EXE_kiln");
    std::fs::create_dir_all(root.join("proc/self")).unwrap();
    std::os::unix::fs::symlink(kiln, root.join("proc/self/exe")).unwrap();
    write(root, "proc/self/maps", b"");
    let extlinux = "label kiln\n    append console=ttyAMA0 panic=-1 ${kiln_args}\n";
    write(root, "boot/extlinux/extlinux.conf", extlinux.as_bytes());
    write(root, "proc/cmdline", b"console=ttyAMA0 panic=-1\n");
    let sha = |b: &[u8]| hex::encode(<sha2::Sha256 as sha2::Digest>::digest(b));
    let manifest = serde_json::json!({
        "kiln_manifest": 1,
        "board": "qemu-virt",
        "runtime": {"path": "/usr/bin/kiln", "sha256": sha(&std::fs::read(kiln).unwrap())},
        "boot": {"files": {"/extlinux/extlinux.conf": {"sha256": sha(extlinux.as_bytes())}}},
        "models": [{"name": "m.gguf", "sha256": sha(&model)}],
        "fixtures": [{"name": fixture::FILE_NAME, "sha256": sha(&llama)}],
        "known_answers": {"matmul": matmul, "nll": [nll]},
    });
    let manifest = serde_json::to_vec_pretty(&manifest).unwrap();
    write(root, "boot/kiln/manifest.json", &manifest);

    let (code, stdout) = selftest(root);
    assert_eq!(code, 0, "{stdout}");
    let (console, line) = Report::from_console(&stdout).unwrap();
    assert_eq!(console.verdict, Verdict::Pass);
    let file: Report =
        serde_json::from_slice(&std::fs::read(root.join("boot/kiln/report.json")).unwrap())
            .unwrap();
    assert_eq!(file, console);
    assert!(
        line.ends_with(&format!("manifest={}", sha(&manifest))),
        "{line}"
    );
    assert!(std::fs::read_to_string(root.join("boot/kiln/report.txt"))
        .unwrap()
        .contains("KILN-SELFTEST: PASS"));

    // For a person at the console (init without kiln.mode=test): the table of report.txt,
    // ending in the same verdict line, and no JSON.
    let (code, text) = selftest_with(root, &["--console", "text"]);
    assert_eq!(code, 0, "{text}");
    let txt = std::fs::read_to_string(root.join("boot/kiln/report.txt")).unwrap();
    let mask = |t: &str| -> String {
        // Durations differ between two runs; the rest of the table must not.
        t.lines()
            .map(|l| {
                l.split_whitespace()
                    .filter(|w| w.parse::<f64>().is_err())
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(mask(&text), mask(&txt), "the console text is report.txt");
    assert!(!text.contains("KILN-REPORT-BEGIN") && !text.contains("{\"schema\""));
    assert!(text
        .trim_end()
        .lines()
        .last()
        .unwrap()
        .starts_with("KILN-SELFTEST: PASS"));

    // The wrong kernel: exit 1, and the files say FAIL too.
    write(root, "proc/sys/kernel/osrelease", b"6.1.0-57-arm64\n");
    let (code, stdout) = selftest(root);
    assert_eq!(code, 1, "{stdout}");
    let (console, line) = Report::from_console(&stdout).unwrap();
    assert!(line.starts_with("KILN-SELFTEST: FAIL"), "{line}");
    assert!(console.failed_ids().contains(&"kernel.release"));
    let file: Report =
        serde_json::from_slice(&std::fs::read(root.join("boot/kiln/report.json")).unwrap())
            .unwrap();
    assert_eq!(file, console);
}
