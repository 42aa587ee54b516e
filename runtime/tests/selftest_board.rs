//! `kiln selftest` end to end over a fake qemu-virt root (`/proc`, `/sys`, `/dev`, `/boot`,
//! `/models` as plain files) with the NPU stand-in as librknnrt: a healthy board passes, and
//! each fault the stand-in injects (`KILN_RKNN_STANDIN_FAULT`) fails the NPU's matmul checks,
//! those and nothing else, and the verdict. One test, in sequence: the fault and the library are
//! chosen by process-wide variables.

mod npu_common;

use kiln_runtime::gguf::writer::GgufWriter;
use kiln_runtime::quant::{quantize_to_vec, GgmlType};
use kiln_runtime::selftest::report::Verdict;
use kiln_runtime::selftest::{board::Board, run_all, Ctx, Inject, Paths, Status};
use std::io::Write as _;
use std::path::Path;

const BOARD: &str = r##"
[board]
name = "qemu-virt"
npu = false
[expect]
kernel_release = "6.1.192-kiln"
kernel_config = ["CONFIG_EROFS_FS=y", "# CONFIG_MODULES is not set"]
cpu_features = ["asimd", "asimddp"]
npu_runtime = "2.3.2"
"##;

fn write(root: &Path, rel: &str, bytes: &[u8]) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, bytes).unwrap();
}

fn fake_qemu_virt(root: &Path) {
    write(root, "proc/sys/kernel/osrelease", b"6.1.192-kiln\n");
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(b"# Linux/arm64 6.1.192 Kernel Configuration\nCONFIG_EROFS_FS=y\n# CONFIG_MODULES is not set\n")
        .unwrap();
    write(root, "proc/config.gz", &gz.finish().unwrap());
    write(
        root,
        "proc/cpuinfo",
        b"processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\n",
    );
    write(
        root,
        "dev/kmsg",
        b"6,1,0,-;Booting Linux on physical CPU 0x0000000000 [0x414fd0b0]\n6,2,10,-;Run /init as init process\n",
    );
    write(
        root,
        "boot/kiln/manifest.json",
        b"{\"board\":\"qemu-virt\"}\n",
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
    write(root, "models/kiln-selftest.gguf", &w.to_bytes());
}

#[test]
fn healthy_board_passes_and_every_npu_fault_fails_its_checks() {
    let lib = npu_common::standin("KILN_RKNN_STANDIN");
    std::env::set_var("KILN_RKNN_LIB", &lib);
    let root = tempfile::tempdir().unwrap();
    fake_qemu_virt(root.path());
    let ctx = Ctx {
        paths: Paths::under(root.path()),
        board: Some(Board::parse(BOARD).unwrap()),
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
    assert!(r.verdict_line().contains("image="), "{}", r.verdict_line());
    let mm = by_id("model.mmap");
    assert!(
        mm.evidence.iter().any(|e| e.contains("weights on NPU")),
        "{mm:?}"
    );

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
        assert!(
            failed.iter().all(|id| id.starts_with("matmul.npu.")),
            "{fault} failed an unrelated check: {failed:?}"
        );
    }

    // The self-check's own fault: a weight copied instead of mapped.
    let copy = Ctx {
        inject: Inject::parse("copy").unwrap(),
        ..ctx.clone()
    };
    let r = run_all(&copy);
    assert_eq!(r.verdict, Verdict::Fail);
    assert_eq!(r.failed_ids(), ["model.mmap"], "{}", r.to_text());
}
