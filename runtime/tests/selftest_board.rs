//! `kiln selftest` end to end over a fake qemu-virt root (`/proc`, `/sys`, `/dev`, `/boot`,
//! `/models` as plain files) with the NPU stand-in as librknnrt: a healthy board passes, and
//! each fault the stand-in injects (`KILN_RKNN_STANDIN_FAULT`) fails the NPU's matmul checks,
//! those and nothing else, and the verdict. One test, in sequence: the fault and the library are
//! chosen by process-wide variables.

mod npu_common;

use kiln_runtime::gguf::writer::GgufWriter;
use kiln_runtime::model::fixture;
use kiln_runtime::quant::{quantize_to_vec, GgmlType};
use kiln_runtime::selftest::report::Verdict;
use kiln_runtime::selftest::{
    board::Board, model_matmul, model_nll, run_all, Ctx, Inject, Paths, Status,
};
use std::io::Write as _;
use std::path::Path;

const NLL_TEXT: &str = "The kiln board reads this text at every boot, and the model gives the \
    same numbers the build said it would.";

const BOARD: &str = r##"
[board]
name = "qemu-virt"
npu = false
[expect]
kernel_release = "6.1.192-kiln"
kernel_config = ["CONFIG_EROFS_FS=y", "# CONFIG_MODULES is not set"]
npu_runtime = "2.3.2"
cpu_features = CPU_FEATURES
"##;

/// A `/proc/cpuinfo` whose features are the ones that allow the kernel the CPU backend picks on
/// the machine the test runs on (cpu.features checks that they agree), and which holds the
/// board's pinned `asimd asimddp` wherever sdot runs.
fn cpuinfo_for_this_cpu() -> String {
    let k = kiln_runtime::backend::cpu::CpuBackend::new()
        .kernel()
        .name();
    let features = match k {
        "neon+sdot" => "fp asimd fphp asimdhp asimddp",
        "neon" => "fp asimd fphp asimdhp",
        _ => "fpu sse2",
    };
    format!("processor\t: 0\nFeatures\t: {features}\n")
}

/// The board's pinned CPU features, as far as this machine can have them.
fn pinned_features() -> &'static str {
    match kiln_runtime::backend::cpu::CpuBackend::new()
        .kernel()
        .name()
    {
        "neon+sdot" => r#"["asimd", "asimddp"]"#,
        "neon" => r#"["asimd"]"#,
        _ => r#"["sse2"]"#,
    }
}

fn write(root: &Path, rel: &str, bytes: &[u8]) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, bytes).unwrap();
}

fn fake_qemu_virt(root: &Path, lib: &Path) {
    write(root, "proc/sys/kernel/osrelease", b"6.1.192-kiln\n");
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(b"# Linux/arm64 6.1.192 Kernel Configuration\nCONFIG_EROFS_FS=y\n# CONFIG_MODULES is not set\n")
        .unwrap();
    write(root, "proc/config.gz", &gz.finish().unwrap());
    write(root, "proc/cpuinfo", cpuinfo_for_this_cpu().as_bytes());
    // The CPUs this test may run on, all alike (as QEMU's virt board has them): the selection
    // `cpu.features` applies, and measures the pool on, is all of them.
    let online = kiln_runtime::cpus::format_list(&kiln_runtime::cpus::affinity().unwrap());
    write(
        root,
        "sys/devices/system/cpu/online",
        format!("{online}\n").as_bytes(),
    );
    write(
        root,
        "dev/kmsg",
        b"6,1,0,-;Booting Linux on physical CPU 0x0000000000 [0x414fd0b0]\n6,2,10,-;Run /init as init process\n",
    );
    // A model the NPU can own (F16, Q8_0 with K % 32 == 0, N % 32 == 0) and the CPU the rest.
    let mut w = GgufWriter::new();
    let x: Vec<f32> = (0..64 * 64)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
        .collect();
    let f16: Vec<u8> = x
        .iter()
        .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
        .collect();
    w.tensor("blk.0.attn_q.weight", GgmlType::F16, &[64, 64], f16)
        .unwrap();
    w.tensor(
        "blk.0.ffn_up.weight",
        GgmlType::Q8_0,
        &[64, 64],
        quantize_to_vec(GgmlType::Q8_0, &x).unwrap(),
    )
    .unwrap();
    w.tensor(
        "blk.0.ffn_down.weight",
        GgmlType::Q4_0,
        &[64, 64],
        quantize_to_vec(GgmlType::Q4_0, &x).unwrap(),
    )
    .unwrap();
    w.tensor_f32("output_norm.weight", &[64], &x[..64]).unwrap();
    let model = w.to_bytes();
    write(root, "models/kiln-selftest.gguf", &model);
    // The seeded llama fixture and its known answer, recorded on the reference path as the
    // image build records it.
    let llama = fixture::gguf().unwrap();
    write(root, &format!("models/{}", fixture::FILE_NAME), &llama);
    let answer = model_nll::record(
        &root.join("models").join(fixture::FILE_NAME),
        fixture::FILE_NAME,
        NLL_TEXT,
    )
    .unwrap();

    // The fixture's matmul known answers, recorded on the reference path as the image build
    // records them.
    let mut matmul = model_matmul::record(
        &root.join("models/kiln-selftest.gguf"),
        "kiln-selftest.gguf",
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

    // What image.manifest compares: this process's own exe and maps (the stand-in it loads),
    // the boot files, the model, the command line.
    std::fs::create_dir_all(root.join("proc/self")).unwrap();
    // The test binary itself, not a link to "/proc/self/exe": under qemu-user the kernel would
    // resolve that link to the emulator (only qemu's own open of "/proc/self/exe" is translated).
    let exe = std::env::current_exe().unwrap();
    std::os::unix::fs::symlink(&exe, root.join("proc/self/exe")).unwrap();
    std::os::unix::fs::symlink("/proc/self/maps", root.join("proc/self/maps")).unwrap();
    let extlinux =
        "label kiln\n    kernel /Image\n    append console=ttyAMA0 panic=-1 ${kiln_args}\n";
    write(root, "boot/extlinux/extlinux.conf", extlinux.as_bytes());
    write(root, "boot/Image", b"kernel");
    write(
        root,
        "proc/cmdline",
        b"console=ttyAMA0 panic=-1 kiln.mode=test\n",
    );
    let sha = |b: &[u8]| hex::encode(<sha2::Sha256 as sha2::Digest>::digest(b));
    let manifest = serde_json::json!({
        "kiln_manifest": 1,
        "board": "qemu-virt",
        "runtime": {"path": "/usr/bin/kiln", "sha256": sha(&std::fs::read(&exe).unwrap())},
        "npu_runtime": {"path": "/usr/lib/librknnrt.so", "sha256": sha(&std::fs::read(lib).unwrap())},
        "boot": {"files": {
            "/Image": {"sha256": sha(b"kernel")},
            "/extlinux/extlinux.conf": {"sha256": sha(extlinux.as_bytes())},
        }},
        "models": [],
        "fixture": {"name": "kiln-selftest.gguf", "sha256": sha(&model)},
        "fixtures": [{"name": fixture::FILE_NAME, "sha256": sha(&llama)}],
        "known_answers": {"nll": [answer], "matmul": matmul},
    });
    write(
        root,
        "boot/kiln/manifest.json",
        &serde_json::to_vec_pretty(&manifest).unwrap(),
    );
}

#[test]
fn healthy_board_passes_and_every_npu_fault_fails_its_checks() {
    let lib = npu_common::standin("KILN_RKNN_STANDIN");
    std::env::set_var("KILN_RKNN_LIB", &lib);
    let root = tempfile::tempdir().unwrap();
    fake_qemu_virt(root.path(), &lib);
    let ctx = Ctx {
        paths: Paths::under(root.path()),
        board: Some(Board::parse(&BOARD.replace("CPU_FEATURES", pinned_features())).unwrap()),
        inject: Inject::default(),
    };

    std::env::remove_var("KILN_RKNN_STANDIN_FAULT");
    let r = run_all(&ctx);
    assert_eq!(r.verdict, Verdict::Pass, "{}", r.to_text());
    let by_id = |id: &str| r.checks.iter().find(|c| c.id == id).unwrap().clone();
    let rt = by_id("npu.runtime");
    assert!(rt.simulated && rt.status == Status::Pass, "{rt:?}");
    assert_eq!(by_id("npu.driver").status, Status::Skip);
    assert!(r
        .checks
        .iter()
        .any(|c| c.id == "matmul.npu.f16" && c.simulated));
    assert!(r.checks.iter().any(|c| c.id == "matmul.npu.q8_0"));
    assert!(
        r.verdict_line().contains("manifest="),
        "{}",
        r.verdict_line()
    );
    let im = by_id("image.manifest");
    assert!(
        im.evidence
            .iter()
            .any(|e| e.contains("librknn_standin.so (loaded)")),
        "{im:?}"
    );
    let mm = by_id("model.mmap");
    assert!(
        mm.evidence.iter().any(|e| e.contains("weights on NPU")),
        "{mm:?}"
    );
    let cf = by_id("cpu.features");
    assert!(
        cf.evidence.iter().any(|e| e.starts_with("inference cpus "))
            && cf
                .evidence
                .iter()
                .any(|e| e.starts_with("matmul pool threads measured on cpus ")),
        "{cf:?}"
    );
    // The model-level known answer in both configurations, the NPU running some of the
    // model's matmuls in the second.
    for id in ["model.nll.cpu", "model.nll.npu"] {
        let c = by_id(id);
        assert_eq!(c.status, Status::Pass, "{c:?}");
        eprintln!("{id}: {}", c.evidence.join(" | "));
    }
    assert!(by_id("model.nll.npu").simulated);
    let ev = &by_id("model.nll.npu").evidence;
    assert!(ev[0].starts_with("known answers from "), "{ev:?}");
    assert!(ev[1].contains("npu "), "{ev:?}");

    for fault in ["error", "untouched", "stale", "wrong"] {
        std::env::set_var("KILN_RKNN_STANDIN_FAULT", fault);
        let r = run_all(&ctx);
        std::env::remove_var("KILN_RKNN_STANDIN_FAULT");
        assert_eq!(r.verdict, Verdict::Fail, "{fault}: {}", r.to_text());
        let failed = r.failed_ids();
        assert!(
            failed.contains(&"matmul.npu.f16") && failed.contains(&"matmul.npu.q8_0"),
            "{fault}: {failed:?}"
        );
        // The model's forward pass on the NPU: an error (error, untouched) or a wrong NLL
        // (wrong). `stale` replays a context's previous output, and the known answer runs each
        // weight's context once (one prefill of a freshly loaded model): nothing to replay, so
        // it is the matmul checks (two runs each) that must catch it.
        if fault == "stale" {
            continue;
        }
        assert!(failed.contains(&"model.nll.npu"), "{fault}: {failed:?}");
        assert!(
            failed.iter().all(|id| id.starts_with("matmul.npu.")
                || *id == "model.nll.npu"
                || *id == "model.matmul.npu"),
            "{fault} failed an unrelated check: {failed:?}"
        );
        let c = r.checks.iter().find(|c| c.id == "model.nll.npu").unwrap();
        let why = c.reason.as_deref().unwrap();
        assert!(
            why.contains(fixture::FILE_NAME) && why.contains("[npu+cpu]"),
            "{why}"
        );
        if fault == "wrong" {
            assert!(why.contains("the build recorded"), "{why}");
        }
        eprintln!("fault {fault}: model.nll.npu FAIL: {why}");
    }

    // The self-check's own fault: a weight copied instead of mapped.
    let copy = Ctx {
        inject: Inject::parse("copy").unwrap(),
        ..ctx.clone()
    };
    let r = run_all(&copy);
    assert_eq!(r.verdict, Verdict::Fail);
    assert_eq!(r.failed_ids(), ["model.mmap"], "{}", r.to_text());

    // A manifest edited to another kiln hash: image.manifest, and nothing else, fails.
    let mpath = root.path().join("boot/kiln/manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    m["runtime"]["sha256"] = "ab".repeat(32).into();
    std::fs::write(&mpath, serde_json::to_vec(&m).unwrap()).unwrap();
    let r = run_all(&ctx);
    assert_eq!(r.failed_ids(), ["image.manifest"], "{}", r.to_text());
    let im = r.checks.iter().find(|c| c.id == "image.manifest").unwrap();
    assert!(
        im.reason.as_deref().unwrap().contains("/usr/bin/kiln"),
        "{im:?}"
    );
    // No manifest at all: nothing to compare the files nor the model's answer with.
    std::fs::remove_file(&mpath).unwrap();
    let r = run_all(&ctx);
    assert_eq!(
        r.failed_ids(),
        [
            "model.matmul.npu",
            "model.matmul.cpu",
            "model.nll.cpu",
            "model.nll.npu",
            "image.manifest"
        ],
        "{}",
        r.to_text()
    );
}
