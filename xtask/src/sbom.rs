//! `cargo xtask sbom`: SPDX 2.3 and CycloneDX 1.6 SBOMs from an image's `manifest.json`
//! (a pipeline over the manifest: nothing is rebuilt). The JSON is written with serde_json: no
//! crate writes both formats from the facts the manifest holds. Document ids and timestamps
//! come from the commit and `source_date_epoch` in the manifest, never the clock, so the same
//! manifest gives the same bytes. `cargo xtask image` writes both beside the image (its `sboms`
//! step, remade when the manifest or this module changes).
//!
//! Covered so far: the Debian inputs (`pkg:deb/debian/…`), the kernel built from source (with the
//! Linux kernel CPE), `kiln` itself (the commit), the models and fixtures of the models partition.
//! Not yet: the Rust crates of `kiln`, tools-root build tools, licences (all `NOASSERTION`).
//! [`dep5`] turns a Debian `copyright` file into an SPDX expression (or `NOASSERTION`) and is
//! tested, but the image step does not record its result in the manifest yet, so the SBOMs
//! still say `NOASSERTION`.

// Not wired into the manifest yet (see the module doc); its tests run.
#[allow(dead_code)]
pub mod dep5;

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::{json, Value};
use std::path::PathBuf;

/// Write the SPDX 2.3 and/or CycloneDX 1.6 SBOM of a built image beside it in target/images/.
#[derive(Parser)]
pub struct Args {
    /// Board whose image manifest (`target/images/manifest.json`) is read
    #[arg(long, default_value = "qemu-virt")]
    pub board: String,
    /// Which formats to write: spdx, cyclonedx or both
    #[arg(long, default_value = "both")]
    pub format: String,
}

/// One thing in the image or shaping its bytes.
#[derive(Debug, PartialEq)]
pub struct Item {
    pub kind: &'static str,
    pub name: String,
    pub version: String,
    pub sha256: String,
    pub purl: Option<String>,
    pub cpe: Option<String>,
}

fn s(v: &Value, what: &str) -> Result<String> {
    v.as_str()
        .map(str::to_string)
        .with_context(|| format!("manifest: {what} is not a string"))
}

/// The items of a manifest, in manifest order.
pub fn items(m: &Value) -> Result<Vec<Item>> {
    let mut out = Vec::new();
    let commit = s(&m["commit"], "commit")?;
    for i in m["inputs"].as_array().context("manifest: no inputs")? {
        let (name, version) = (
            s(&i["name"], "inputs[].name")?,
            s(&i["version"], "inputs[].version")?,
        );
        let source = i["source"].as_str().unwrap_or_default();
        let arch = source
            .split_once(':')
            .and_then(|(_, r)| r.split_once('='))
            .map(|(a, _)| a.to_string())
            .unwrap_or_else(|| "arm64".into());
        let purl = source.starts_with("debian ").then(|| {
            format!(
                "pkg:deb/debian/{name}@{}?arch={arch}&distro=debian-12",
                version.replace(':', "%3A").replace('+', "%2B")
            )
        });
        let is_kernel = name.starts_with("linux-source");
        out.push(Item {
            kind: if is_kernel {
                "kernel-source"
            } else {
                "debian-package"
            },
            name,
            version,
            sha256: s(&i["sha256"], "inputs[].sha256")?,
            purl,
            cpe: None,
        });
    }
    let k = &m["kernel"];
    let release = s(&k["release"], "kernel.release")?;
    let upstream = release.split('-').next().unwrap_or(&release).to_string();
    out.push(Item {
        kind: "kernel",
        name: "linux".into(),
        version: release.clone(),
        sha256: s(&k["image_sha256"], "kernel.image_sha256")?,
        purl: Some(format!("pkg:generic/linux@{release}")),
        cpe: Some(format!(
            "cpe:2.3:o:linux:linux_kernel:{upstream}:*:*:*:*:*:*:*"
        )),
    });
    out.push(Item {
        kind: "kiln",
        name: "kiln".into(),
        version: commit.clone(),
        sha256: s(&m["runtime"]["sha256"], "runtime.sha256")?,
        purl: Some(format!("pkg:generic/kiln@{commit}")),
        cpe: None,
    });
    let files = m["models"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|x| ("model", x))
        .chain(std::iter::once(("fixture", &m["fixture"])))
        .chain(
            m["fixtures"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|x| ("fixture", x)),
        );
    for (kind, f) in files {
        let name = s(&f["name"], "models/fixture name")?;
        let sha = s(&f["sha256"], "models/fixture sha256")?;
        out.push(Item {
            kind,
            purl: Some(format!("pkg:generic/{name}?checksum=sha256:{sha}")),
            name,
            version: sha[..12.min(sha.len())].to_string(),
            sha256: sha,
            cpe: None,
        });
    }
    Ok(out)
}

fn created(m: &Value) -> Result<String> {
    let epoch = m["source_date_epoch"]
        .as_i64()
        .context("manifest: no source_date_epoch")?;
    let t = time_of(epoch);
    Ok(t)
}

/// `YYYY-MM-DDTHH:MM:SSZ` of a Unix time.
fn time_of(epoch: i64) -> String {
    let (days, secs) = (epoch.div_euclid(86400), epoch.rem_euclid(86400));
    let (y, mo, d) = crate::civil::civil_from_days(days);
    format!(
        "{y:04}-{mo:02}-{d:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}

fn spdx_id(i: usize, it: &Item) -> String {
    let clean: String = it
        .name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    format!("SPDXRef-{i}-{clean}")
}

/// The SPDX 2.3 document of a manifest.
pub fn spdx(m: &Value) -> Result<Value> {
    let its = items(m)?;
    let board = s(&m["board"], "board")?;
    let commit = s(&m["commit"], "commit")?;
    let image = &m["image"];
    let mut packages = vec![json!({
        "SPDXID": "SPDXRef-image",
        "name": format!("kiln-{board}.img"),
        "versionInfo": commit,
        "downloadLocation": "NOASSERTION",
        "filesAnalyzed": false,
        "checksums": [{"algorithm": "SHA256", "checksumValue": s(&image["sha256"], "image.sha256")?}],
        "licenseConcluded": "NOASSERTION",
        "licenseDeclared": "NOASSERTION",
        "copyrightText": "NOASSERTION",
        "primaryPackagePurpose": "OPERATING-SYSTEM",
    })];
    let mut rels = vec![json!({
        "spdxElementId": "SPDXRef-DOCUMENT", "relationshipType": "DESCRIBES",
        "relatedSpdxElement": "SPDXRef-image",
    })];
    for (n, it) in its.iter().enumerate() {
        let id = spdx_id(n, it);
        let mut refs = Vec::new();
        if let Some(p) = &it.purl {
            refs.push(json!({"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl", "referenceLocator": p}));
        }
        if let Some(c) = &it.cpe {
            refs.push(json!({"referenceCategory": "SECURITY", "referenceType": "cpe23Type", "referenceLocator": c}));
        }
        packages.push(json!({
            "SPDXID": id,
            "name": it.name,
            "versionInfo": it.version,
            "downloadLocation": "NOASSERTION",
            "filesAnalyzed": false,
            "checksums": [{"algorithm": "SHA256", "checksumValue": it.sha256}],
            "licenseConcluded": "NOASSERTION",
            "licenseDeclared": "NOASSERTION",
            "copyrightText": "NOASSERTION",
            "externalRefs": refs,
            "comment": format!("kiln kind: {}", it.kind),
        }));
        let (a, t, b) = match it.kind {
            "kernel-source" => (id, "GENERATED_FROM", "SPDXRef-kernel".to_string()),
            _ => ("SPDXRef-image".to_string(), "CONTAINS", id),
        };
        rels.push(json!({"spdxElementId": a, "relationshipType": t, "relatedSpdxElement": b}));
    }
    // The kernel package gets a stable id the kernel source points at.
    for p in &mut packages {
        if p["name"] == "linux" {
            let old = p["SPDXID"].clone();
            p["SPDXID"] = json!("SPDXRef-kernel");
            for r in &mut rels {
                if r["relatedSpdxElement"] == old {
                    r["relatedSpdxElement"] = json!("SPDXRef-kernel");
                }
            }
        }
    }
    // GENERATED_FROM reads "A generated from B": the kernel from its source.
    for r in &mut rels {
        if r["relationshipType"] == "GENERATED_FROM" {
            let (a, b) = (r["spdxElementId"].clone(), r["relatedSpdxElement"].clone());
            r["spdxElementId"] = b;
            r["relatedSpdxElement"] = a;
        }
    }
    Ok(json!({
        "spdxVersion": "SPDX-2.3",
        "dataLicense": "CC0-1.0",
        "SPDXID": "SPDXRef-DOCUMENT",
        "name": format!("kiln-{board}"),
        "documentNamespace": format!("https://kiln.invalid/spdx/{board}/{commit}"),
        "creationInfo": {"created": created(m)?, "creators": ["Tool: kiln-xtask"]},
        "packages": packages,
        "relationships": rels,
    }))
}

/// A UUID-shaped serial number from the board and commit (not random: same commit, same bytes).
fn serial(board: &str, commit: &str) -> String {
    use sha2::{Digest, Sha256};
    let h = Sha256::digest(format!("kiln-sbom:{board}:{commit}").as_bytes());
    let x: String = h.iter().take(16).map(|b| format!("{b:02x}")).collect();
    format!(
        "urn:uuid:{}-{}-5{}-8{}-{}",
        &x[0..8],
        &x[8..12],
        &x[13..16],
        &x[17..20],
        &x[20..32]
    )
}

/// The CycloneDX 1.6 document of a manifest.
pub fn cyclonedx(m: &Value) -> Result<Value> {
    let its = items(m)?;
    let board = s(&m["board"], "board")?;
    let commit = s(&m["commit"], "commit")?;
    let comps: Vec<Value> = its
        .iter()
        .enumerate()
        .map(|(n, it)| {
            let ty = match it.kind {
                "debian-package" | "kernel-source" | "kiln" => "application",
                "kernel" => "operating-system",
                _ => "data",
            };
            let ty = if it.kind == "debian-package" {
                "library"
            } else {
                ty
            };
            let mut c = json!({
                "type": ty,
                "bom-ref": spdx_id(n, it),
                "name": it.name,
                "version": it.version,
                "hashes": [{"alg": "SHA-256", "content": it.sha256}],
                "properties": [{"name": "kiln:kind", "value": it.kind}],
            });
            if let Some(p) = &it.purl {
                c["purl"] = json!(p);
            }
            if let Some(x) = &it.cpe {
                c["cpe"] = json!(x);
            }
            c
        })
        .collect();
    let refs: Vec<Value> = comps.iter().map(|c| c["bom-ref"].clone()).collect();
    Ok(json!({
        "bomFormat": "CycloneDX",
        "specVersion": "1.6",
        "serialNumber": serial(&board, &commit),
        "version": 1,
        "metadata": {
            "timestamp": created(m)?,
            "component": {
                "type": "firmware", "bom-ref": "image", "name": format!("kiln-{board}.img"),
                "version": commit,
                "hashes": [{"alg": "SHA-256", "content": s(&m["image"]["sha256"], "image.sha256")?}],
            },
        },
        "components": comps,
        "dependencies": [{"ref": "image", "dependsOn": refs}],
    }))
}

/// Write the SBOMs of the manifest at `manifest` into its directory; returns the paths written.
/// The SPDX 2.3 and CycloneDX 1.6 documents of a manifest, as the files hold them.
pub fn documents(m: &Value) -> Result<[Vec<u8>; 2]> {
    Ok([
        serde_json::to_vec_pretty(&spdx(m)?)?,
        serde_json::to_vec_pretty(&cyclonedx(m)?)?,
    ])
}

/// This module's source: part of the image's SBOM step key, so that a change to what the SBOMs
/// say makes them again.
pub const SOURCE: &str = include_str!("sbom.rs");

pub fn write(manifest: &std::path::Path, format: &str) -> Result<Vec<PathBuf>> {
    let m: Value = serde_json::from_slice(
        &std::fs::read(manifest).with_context(|| format!("reading {}", manifest.display()))?,
    )
    .with_context(|| format!("parsing {}", manifest.display()))?;
    let board = s(&m["board"], "board")?;
    let dir = manifest.parent().context("manifest has no directory")?;
    let mut out = Vec::new();
    let (sp, cd) = match format {
        "spdx" => (true, false),
        "cyclonedx" => (false, true),
        "both" => (true, true),
        f => bail!("--format {f}: expected spdx, cyclonedx or both"),
    };
    if sp {
        let p = dir.join(format!("kiln-{board}.spdx.json"));
        crate::atomic::write_atomic(&p, &serde_json::to_vec_pretty(&spdx(&m)?)?)?;
        out.push(p);
    }
    if cd {
        let p = dir.join(format!("kiln-{board}.cdx.json"));
        crate::atomic::write_atomic(&p, &serde_json::to_vec_pretty(&cyclonedx(&m)?)?)?;
        out.push(p);
    }
    Ok(out)
}

pub fn run(a: Args) -> Result<()> {
    let manifest = crate::paths::target_dir().join("images/manifest.json");
    let m: Value = serde_json::from_slice(&std::fs::read(&manifest).with_context(|| {
        format!(
            "reading {} (run cargo xtask image first)",
            manifest.display()
        )
    })?)?;
    if m["board"] != a.board.as_str() {
        bail!(
            "{} is the manifest of board {}, not {} (run cargo xtask image --board {})",
            manifest.display(),
            m["board"],
            a.board,
            a.board
        );
    }
    for p in write(&manifest, &a.format)? {
        println!("sbom: {}", p.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest() -> Value {
        json!({
            "board": "qemu-virt", "commit": "ce98691998e7fe36e0b2c29d74b0476de3e837df",
            "source_date_epoch": 1796312582,
            "inputs": [
                {"name": "libc6", "version": "2.36-9+deb12u14", "sha256": "01f4", "source": "debian libc6:arm64=2.36-9+deb12u14"},
                {"name": "linux-source-6.1", "version": "6.1.192-3", "sha256": "5259", "source": "debian linux-source-6.1:all=6.1.192-3"},
            ],
            "kernel": {"release": "6.1.192-kiln", "image_sha256": "4596"},
            "runtime": {"sha256": "d6e5"},
            "models": [],
            "fixture": {"name": "kiln-selftest.gguf", "sha256": "5b20"},
            "fixtures": [{"name": "kiln-llama-fixture.gguf", "sha256": "081e"}],
            "image": {"sha256": "aa1e"},
        })
    }

    #[test]
    fn sbom_has_every_manifest_entry_and_nothing_else() {
        let m = manifest();
        let want = ["01f4", "5259", "4596", "d6e5", "5b20", "081e"];
        let sp = spdx(&m).unwrap();
        let mut got: Vec<String> = sp["packages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                p["checksums"][0]["checksumValue"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        assert_eq!(got.remove(0), "aa1e");
        assert_eq!(got, want);
        let cd = cyclonedx(&m).unwrap();
        let got: Vec<&str> = cd["components"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["hashes"][0]["content"].as_str().unwrap())
            .collect();
        assert_eq!(got, want);
        assert_eq!(
            cd["components"][0]["purl"],
            "pkg:deb/debian/libc6@2.36-9%2Bdeb12u14?arch=arm64&distro=debian-12"
        );
        assert_eq!(
            cd["components"][2]["cpe"],
            "cpe:2.3:o:linux:linux_kernel:6.1.192:*:*:*:*:*:*:*"
        );
    }

    #[test]
    fn sbom_is_deterministic_and_dated_from_the_manifest() {
        let m = manifest();
        let a = serde_json::to_vec_pretty(&spdx(&m).unwrap()).unwrap();
        assert_eq!(a, serde_json::to_vec_pretty(&spdx(&m).unwrap()).unwrap());
        assert_eq!(
            spdx(&m).unwrap()["creationInfo"]["created"],
            "2026-12-03T15:43:02Z"
        );
        assert_eq!(time_of(0), "1970-01-01T00:00:00Z");
        assert_eq!(time_of(951782400), "2000-02-29T00:00:00Z");
        let mut m2 = m.clone();
        m2["commit"] = json!("0000000000000000000000000000000000000000");
        assert_ne!(
            cyclonedx(&m).unwrap()["serialNumber"],
            cyclonedx(&m2).unwrap()["serialNumber"]
        );
    }
}
