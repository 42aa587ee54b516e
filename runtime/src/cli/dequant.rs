//! `kiln dequant`: one tensor as raw little-endian f32.

use anyhow::Context;
use kiln_runtime::gguf::GgufFile;
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct Args {
    /// The GGUF file.
    file: PathBuf,
    /// The tensor's name, as `kiln inspect` lists it.
    tensor: String,
    /// Where to write its values (raw little-endian f32).
    #[arg(short = 'o', long = "output")]
    output: PathBuf,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    dequant(&a.file, &a.tensor, &a.output)
}

fn dequant(file: &Path, tensor: &str, output: &Path) -> anyhow::Result<()> {
    let f = GgufFile::open(file)?;
    let t = super::tensor(&f, tensor)?;
    let at = f.gguf().data_offset + t.offset;
    let values = t.to_f32().with_context(|| {
        format!(
            "{}: at byte {at}: tensor {tensor:?} ({} {:?})",
            file.display(),
            t.ty,
            &t.ne[..t.n_dims as usize]
        )
    })?;
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    super::write_atomic(output, &bytes)
}
