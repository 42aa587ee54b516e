//! The image step `known answers (matmul)`: for every model on the models partition (the
//! self-check's fixtures and each `--model`), `C = A·Wᵀ` of a few real weights computed on the
//! host with the runtime's scalar reference (`kiln_runtime::selftest::model_matmul::record`).
//! The values go into the manifest under `known_answers.matmul`; at boot `model.matmul.<backend>`
//! recomputes them from the mapped models and compares.

use super::context::Ctx;
use super::runner::{key_of, Product, Step};
use super::steps::Model;
use crate::atomic::write_atomic;
use crate::pins::Sha256;
use anyhow::{Context, Result};
use kiln_runtime::selftest::model_matmul::{self, KnownMatmul};
use serde_json::Value;
use std::path::PathBuf;

/// The step: `known-matmul.json` in the work folder, keyed by the models and the recipe of the
/// answers (seed, row count, tolerance, M values). v2: a fused weight (phi3's `attn_qkv`,
/// `ffn_up`) is recorded with one row range per part.
pub fn matmul_step<'a>(
    ctx: &'a Ctx,
    models: &'a [Model],
    fixtures: &'a [(&'a str, &'a [u8])],
) -> Step<'a> {
    let seed = model_matmul::DEFAULT_SEED;
    let recipe = format!(
        "seed={seed} rows={} ms={:?} tol={:?}",
        model_matmul::ROWS,
        model_matmul::MS,
        model_matmul::TOLERANCE
    );
    let key = key_of(&[
        "known-matmul-v2",
        &recipe,
        &fixtures
            .iter()
            .map(|(name, bytes)| format!("{name}={}", Sha256::of_bytes(bytes)))
            .collect::<Vec<_>>()
            .join(","),
        &super::steps::models_key(models),
    ]);
    Step {
        name: "known answers (matmul)",
        key,
        outputs: vec![ctx.work.join("known-matmul.json")],
        make: Box::new(move |tmp: &[PathBuf]| {
            let mut all: Vec<KnownMatmul> = Vec::new();
            for (name, bytes) in fixtures {
                let fixture_path = ctx.work.join("known-fixture.gguf.tmp");
                write_atomic(&fixture_path, bytes)?;
                all.extend(
                    model_matmul::record(&fixture_path, name, seed)
                        .with_context(|| format!("known answers of the fixture {name}"))?,
                );
                std::fs::remove_file(&fixture_path)?;
            }
            for m in models {
                println!("image:   known answers of {} (cpu-ref)", m.name);
                all.extend(
                    model_matmul::record(&m.path, &m.name, seed)
                        .with_context(|| format!("known answers of {}", m.path.display()))?,
                );
            }
            write_atomic(&tmp[0], &serde_json::to_vec(&all)?)?;
            let tensors: std::collections::BTreeSet<(&str, &str)> = all
                .iter()
                .map(|k| (k.model.as_str(), k.tensor.as_str()))
                .collect();
            Ok(format!(
                "{} answers, {} tensors of {} model(s), seed {seed:#x}",
                all.len(),
                tensors.len(),
                models.len() + fixtures.len()
            ))
        }),
    }
}

/// Put the step's answers into the manifest at `known_answers.matmul`, leaving any other
/// `known_answers` entry as it is.
pub fn add_matmul(manifest: &mut Value, known: &Product) -> Result<()> {
    let path = known.path();
    let list: Value = serde_json::from_slice(
        &std::fs::read(path).with_context(|| format!("reading {}", path.display()))?,
    )
    .with_context(|| format!("parsing {}", path.display()))?;
    let obj = manifest
        .as_object_mut()
        .context("the manifest is not a JSON object")?;
    let ka = obj
        .entry("known_answers")
        .or_insert_with(|| Value::Object(Default::default()));
    ka.as_object_mut()
        .context("manifest known_answers is not an object")?
        .insert("matmul".into(), list);
    Ok(())
}
