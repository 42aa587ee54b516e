//! A board's root with one model on its models partition, the known answers recorded as the
//! image build records them, and the self-check's model checks run over it as `kiln selftest`
//! runs them — without a boot.
//!
//! Recorded as `xtask/src/image/known.rs` (`model_matmul::record` with `DEFAULT_SEED`) and
//! `xtask/src/image/steps.rs::known_answers_nll` (`model_nll::record` of `known-answer.txt`, the
//! same file, trimmed the same way) record them, from the model file on the host; checked by the
//! functions `selftest::run_all` calls (`model.mmap`, `coverage`, `model.matmul.cpu`,
//! `model.nll.cpu`) with the board's CPU backend, over the copy on the root's `models/`.

use kiln_runtime::backend::cpu::CpuBackend;
use kiln_runtime::backend::Backend;
use kiln_runtime::gguf::Gguf;
use kiln_runtime::quant::GgmlType;
use kiln_runtime::selftest::board::Board;
use kiln_runtime::selftest::model_matmul::{self, KnownMatmul};
use kiln_runtime::selftest::model_nll::{self, NllAnswer};
use kiln_runtime::selftest::{models, Ctx, Outcome, Paths, Status};
use std::path::{Path, PathBuf};

/// The text the image records every model's token ids and NLL on (`known_text()` in xtask).
pub fn known_text() -> &'static str {
    include_str!("../../../xtask/src/image/known-answer.txt").trim_end()
}

pub struct BoardRoot {
    pub dir: tempfile::TempDir,
    /// The model's file name on the models partition.
    pub name: String,
    pub matmul: Vec<KnownMatmul>,
    pub nll: NllAnswer,
}

impl BoardRoot {
    /// `model` copied to `models/<name>` of a new root, its known answers recorded from `model`
    /// and written to `boot/kiln/manifest.json`.
    pub fn new(model: &Path, name: &str) -> BoardRoot {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
        std::fs::create_dir_all(dir.path().join("models")).unwrap();
        std::fs::copy(model, dir.path().join("models").join(name))
            .unwrap_or_else(|e| panic!("copying {} to the root: {e}", model.display()));
        let t = std::time::Instant::now();
        let matmul = model_matmul::record(model, name, model_matmul::DEFAULT_SEED)
            .unwrap_or_else(|e| panic!("recording the matmul known answers of {name}: {e:#}"));
        let nll = model_nll::record(model, name, known_text())
            .unwrap_or_else(|e| panic!("recording the NLL known answer of {name}: {e:#}"));
        eprintln!(
            "{name}: known answers recorded as the image does in {:.1} s: {} matmul answer(s); {}",
            t.elapsed().as_secs_f64(),
            matmul.len(),
            nll.summary()
        );
        let r = BoardRoot {
            dir,
            name: name.to_string(),
            matmul,
            nll,
        };
        r.write_manifest(&r.matmul, &r.nll);
        r
    }

    pub fn model_path(&self) -> PathBuf {
        self.dir.path().join("models").join(&self.name)
    }

    /// The manifest with these known answers (an edited answer is a fault the checks must see).
    pub fn write_manifest(&self, matmul: &[KnownMatmul], nll: &NllAnswer) {
        let m = serde_json::json!({"known_answers": {"matmul": matmul, "nll": [nll]}});
        let p = self.dir.path().join("boot/kiln/manifest.json");
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    }

    /// A board context: model checks without their known answers FAIL, not SKIP.
    pub fn ctx(&self) -> Ctx {
        Ctx {
            paths: Paths::under(self.dir.path()),
            board: Some(Board::parse("[board]\nname = \"qemu-virt\"\nnpu = false\n").unwrap()),
            ..Ctx::default()
        }
    }

    /// The self-check's model checks, by id, in report order.
    pub fn checks(&self) -> Vec<(&'static str, Outcome)> {
        let ctx = self.ctx();
        let cpu = CpuBackend::new();
        let board_order: [&dyn Backend; 1] = [&cpu];
        let cpu_only = || -> Vec<Box<dyn Backend>> { vec![Box::new(CpuBackend::new())] };
        vec![
            ("model.mmap", models::mmap(&ctx, &board_order)),
            ("coverage", models::coverage(&ctx, &board_order)),
            ("model.matmul.cpu", model_matmul::check(&ctx, &cpu)),
            (
                "model.nll.cpu",
                model_nll::check(&ctx, "cpu", &cpu_only, None),
            ),
        ]
    }

    /// Every check PASSes; their evidence printed.
    pub fn assert_all_pass(&self) {
        for (id, o) in self.checks() {
            eprintln!("{}: {id} {:?}", self.name, o.status);
            for e in &o.evidence {
                eprintln!("    {e}");
            }
            assert_eq!(o.status, Status::Pass, "{}: {id}: {o:?}", self.name);
        }
    }

    /// The failure reason of check `id`, which must FAIL.
    pub fn fail_reason(&self, id: &str) -> String {
        let (_, o) = self
            .checks()
            .into_iter()
            .find(|(i, _)| *i == id)
            .unwrap_or_else(|| panic!("no check {id}"));
        assert_eq!(o.status, Status::Fail, "{}: {id}: {o:?}", self.name);
        o.reason.unwrap()
    }

    /// Flips bit 6 of the high byte of the f16 scale `d` of the first block of row `row` of
    /// `tensor` in the copy on the models partition (the exponent's top bit: the block's 32
    /// weights scaled by 2^±16). Returns the byte's offset in the file.
    pub fn flip_scale(&self, tensor: &str, row: usize) -> usize {
        let p = self.model_path();
        let mut bytes = std::fs::read(&p).unwrap();
        let g = Gguf::parse(&bytes).unwrap();
        let info = g.tensor_info(tensor).unwrap();
        let view = g.view(&bytes, info).unwrap();
        let d_at = match view.ty {
            GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::Q4K
            | GgmlType::Q5K => 0,
            GgmlType::Q6K => 208,
            t => panic!("{tensor} is {t}: no block scale to flip"),
        };
        let row_bytes = view.ty.row_bytes(view.ne[0]).unwrap() as usize;
        let at =
            (view.data.as_ptr() as usize - bytes.as_ptr() as usize) + row * row_bytes + d_at + 1;
        drop(g);
        bytes[at] ^= 0x40;
        std::fs::write(&p, &bytes).unwrap();
        at
    }
}
