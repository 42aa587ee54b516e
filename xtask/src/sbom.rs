//! `cargo xtask sbom`: SPDX 2.3 and CycloneDX 1.6 SBOMs from an image's `manifest.json`
//! (a pipeline over the manifest: nothing is rebuilt). The JSON is written with serde_json: no
//! crate writes both formats from the facts the manifest holds. Document ids and timestamps
//! come from the commit and `source_date_epoch` in the manifest, never the clock, so the same
//! manifest gives the same bytes. `cargo xtask image` writes both beside the image (its `sboms`
//! step, remade when the manifest or this module changes).
//!
//! The card carries them too: `kiln/sbom/kiln-<board>.spdx.json` and `.cdx.json` on the boot
//! partition, made from the boot manifest (`kiln/manifest.json`, which has no `image`) with
//! [`Root::System`]: the root element is the system on the card (`kiln-<board> system`, version =
//! the commit, no hash; the image that contains the documents cannot be named by its hash), its
//! own SPDX namespace and CycloneDX serial number, and everything below it as beside the image.
//! They are listed in the boot manifest's `boot.files` after they are made (they read nothing of
//! `boot.files`, so they hold neither their own hash nor the manifest's), and `image.manifest`
//! hashes them on the board. Beside them, `kiln/licenses/` holds the licence texts ([`texts`]).
//!
//! Covered so far: the Debian inputs (`pkg:deb/debian/…`), the kernel built from source (with the
//! Linux kernel CPE), `kiln` itself (the commit), the NPU stand-in library when the board installs
//! it, the models and fixtures of the models partition, the Rust crates compiled into `kiln`
//! and the stand-in ([`crates`]: cargo's resolve for aarch64, normal dependencies only, recorded
//! in the manifest's `crates` by the image build), and the tools root's packages as build tools.
//!
//! Debian packages: `licenseDeclared` (SPDX) / `licenses: [{expression}]` (CycloneDX) is what
//! the package's DEP-5 `copyright` file says ([`dep5`], read from the .deb by the image's
//! `licences` step and recorded in the manifest as the input's `license`); where there is no
//! exact SPDX answer (not DEP-5, no copyright file in the package, a licence name with no SPDX
//! id) it is `NOASSERTION` and the manifest's `license_reason` is given as the
//! `kiln:license-noassertion` property / in the comment. `licenseConcluded` is `NOASSERTION`.
//!
//! Build tools: every package of the tools root (the manifest's `tools_root.debs`, from
//! `images/tools-root.toml`: the Debian bookworm amd64 root in which the kernel is compiled and
//! the file systems are made) with its amd64 purl and the .deb's sha256. SPDX: `tool
//! BUILD_TOOL_OF` the image (A is used to build B), no `CONTAINS`; CycloneDX: the components of
//! one formula in `formulation`, not in `components` or the image's dependencies.
//!
//! Crates: `pkg:cargo/<name>@<version>`, the `.crate` file's sha256 (Cargo.lock's `checksum`,
//! labelled so in a property / the comment), `licenseDeclared` = Cargo.toml's `license` when it
//! is a valid SPDX expression (old `A/B` read as `A OR B`), else `NOASSERTION` (CycloneDX keeps
//! the text as a licence name); `licenseConcluded` is `NOASSERTION`. SPDX: `kiln DEPENDS_ON
//! crate` (every crate compiled in, direct or not; CONTAINS is for packages and files inside
//! one), and `crate BUILD_DEPENDENCY_OF kiln` for proc-macros and what only they use (CycloneDX
//! scope `excluded`). Build-dependencies (build scripts) and dev-dependencies are left out.
//!
//! Models and fixtures: the GGUF's own `general.*` keys (name, architecture, licence, basename,
//! size label, version, organization, file type…) and its tensor types, read by kiln's parser when
//! the manifest is written. CycloneDX type `machine-learning-model` with `modelCard` holding only
//! the architecture family; SPDX 2.3 has no model purpose, so `primaryPackagePurpose` `FILE`.
//! A `general.license` that is an SPDX id (in any case: `apache-2.0`) is declared; another is
//! a CycloneDX licence name and SPDX `NOASSERTION`.
//!
//! `kiln` and the NPU stand-in: the workspace's `license` (MIT OR Apache-2.0).
//!
//! Not yet: the crates' build-dependencies; licences of the kernel, the
//! tools root's packages, and of the kernel source package (DEP-5, but it names licences with no
//! exact SPDX id: GPL-2+-or-X11, CRYPTOGAMS, Unicode-data, Xen-interface), all `NOASSERTION`.

pub mod crates;
pub mod dep5;
pub mod texts;

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
    pub sha256: Option<String>,
    pub purl: Option<String>,
    pub cpe: Option<String>,
    pub license: License,
    /// Facts beyond the name and version (CycloneDX properties, the SPDX comment), in order.
    pub facts: Vec<(String, String)>,
    /// For a crate: the `kind`s of the items it is compiled into (`kiln`, `npu-runtime`).
    pub part_of: Vec<&'static str>,
    /// For a crate: false when it runs only at compile time (a proc-macro or what only they use).
    pub linked: bool,
}

/// A declared licence, as far as the manifest knows it.
#[derive(Debug, PartialEq)]
pub enum License {
    None,
    /// A valid SPDX expression.
    Spdx(String),
    /// What the source says, which is no SPDX expression (CycloneDX takes it as a name).
    Name(String),
}

impl License {
    fn of(declared: Option<&str>, to_spdx: impl Fn(&str) -> Option<String>) -> License {
        match declared {
            None => License::None,
            Some(d) => to_spdx(d)
                .map(License::Spdx)
                .unwrap_or_else(|| License::Name(d.to_string())),
        }
    }

    fn spdx(&self) -> &str {
        match self {
            License::Spdx(e) => e,
            _ => "NOASSERTION",
        }
    }

    fn cyclonedx(&self) -> Option<Value> {
        match self {
            License::None => None,
            License::Spdx(e) => Some(json!([{"expression": e}])),
            License::Name(n) => Some(json!([{"license": {"name": n}}])),
        }
    }
}

/// A GGUF `general.license` as an SPDX id: an expression as is, or one id of the SPDX list
/// written in another case (Hugging Face's `apache-2.0`).
pub fn model_license(l: &str) -> Option<String> {
    crates::spdx_expression(l).or_else(|| {
        spdx::identifiers::LICENSES
            .iter()
            .find(|x| x.name.eq_ignore_ascii_case(l.trim()))
            .map(|x| x.name.to_string())
            .filter(|id| spdx::Expression::parse(id).is_ok())
    })
}

impl Item {
    fn new(kind: &'static str, name: String, version: String, sha256: String) -> Item {
        Item {
            kind,
            name,
            version,
            sha256: Some(sha256),
            purl: None,
            cpe: None,
            license: License::None,
            facts: Vec::new(),
            part_of: Vec::new(),
            linked: true,
        }
    }
}

/// The `gguf` object of a model or fixture in the manifest as (property, value) facts.
fn gguf_facts(g: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (k, v) in g.as_object().into_iter().flatten() {
        match v {
            Value::Object(o) => {
                for (k2, v2) in o {
                    out.push((format!("gguf:{k}.{k2}"), v2.to_string()));
                }
            }
            Value::String(x) => out.push((format!("gguf:{k}"), x.clone())),
            x => out.push((format!("gguf:{k}"), x.to_string())),
        }
    }
    out
}

/// The purl of a Debian package of the release `distro` (`debian-12`).
fn deb_purl(name: &str, version: &str, arch: &str, distro: &str) -> String {
    let enc = |s: &str| s.replace(':', "%3A").replace('+', "%2B");
    format!(
        "pkg:deb/debian/{}@{}?arch={arch}&distro={distro}",
        enc(name),
        enc(version)
    )
}

/// The declared licence of a Debian input as the manifest records it (`license`, and
/// `license_reason` when it is `NOASSERTION`), with the reason as a fact.
fn deb_license(i: &Value) -> (License, Vec<(String, String)>) {
    let mut facts = Vec::new();
    if let Some(why) = i["license_reason"].as_str() {
        facts.push(("kiln:license-noassertion".to_string(), why.to_string()));
    }
    let license = match i["license"].as_str() {
        None | Some("NOASSERTION") => License::None,
        Some(e) if spdx::Expression::parse(e).is_ok() => License::Spdx(e.to_string()),
        Some(e) => License::Name(e.to_string()),
    };
    (license, facts)
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
        // `debian <package>:<arch>=<version>`: the purl names the package, which need not be
        // the input's name (rock-5b's linux-image-arm64 is linux-image-6.12.118+deb13-arm64).
        let purl = source.strip_prefix("debian ").map(|rest| {
            let (package, arch) = rest
                .split_once('=')
                .and_then(|(pa, _)| pa.split_once(':'))
                .unwrap_or((name.as_str(), "arm64"));
            let distro = i["distro"].as_str().unwrap_or(crate::pins::DEFAULT_DISTRO);
            deb_purl(package, &version, arch, distro)
        });
        let is_kernel = name.starts_with("linux-source");
        let url = source.strip_prefix("url ");
        let kind = if is_kernel {
            "kernel-source"
        } else if url.is_some() {
            // A file pinned by URL and sha256 (U-Boot's source, the DDR init blob).
            "url-input"
        } else {
            "debian-package"
        };
        let sha = s(&i["sha256"], "inputs[].sha256")?;
        // The image step's reading of the package's DEP-5 copyright file (`NOASSERTION` with
        // its reason when there is no exact SPDX answer).
        let (license, mut facts) = deb_license(i);
        if let Some(u) = url {
            facts.push(("kiln:url".into(), u.to_string()));
        }
        out.push(Item {
            purl,
            license,
            facts,
            ..Item::new(kind, name, version, sha)
        });
    }
    let k = &m["kernel"];
    let release = s(&k["release"], "kernel.release")?;
    let upstream = release.split('-').next().unwrap_or(&release).to_string();
    out.push(Item {
        purl: Some(format!("pkg:generic/linux@{release}")),
        cpe: Some(format!(
            "cpe:2.3:o:linux:linux_kernel:{upstream}:*:*:*:*:*:*:*"
        )),
        ..Item::new(
            "kernel",
            "linux".into(),
            release.clone(),
            s(&k["image_sha256"], "kernel.image_sha256")?,
        )
    });
    // kiln and the stand-in are built from this workspace, whose `license` (Cargo.toml's
    // `[workspace.package]`) every crate of it takes, this one included.
    let ours = || License::Spdx(env!("CARGO_PKG_LICENSE").to_string());
    out.push(Item {
        purl: Some(format!("pkg:generic/kiln@{commit}")),
        license: ours(),
        ..Item::new(
            "kiln",
            "kiln".into(),
            commit.clone(),
            s(&m["runtime"]["sha256"], "runtime.sha256")?,
        )
    });
    // U-Boot built from the inputs above, as written at its LBA outside the partitions (the SPI
    // product, not in the image, is not listed).
    let b = &m["bootloader"];
    let in_image = |p: &&Value| {
        m["raw_blobs"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|r| r["input"] == p["file"])
    };
    if let Some(v) = b["version"].as_str() {
        for p in b["products"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(in_image)
        {
            out.push(Item {
                facts: vec![
                    (
                        "kiln:defconfig".into(),
                        s(&b["defconfig"], "bootloader.defconfig")?,
                    ),
                    (
                        "kiln:bl31-elf-sha256".into(),
                        s(&b["bl31"]["elf_sha256"], "bootloader.bl31")?,
                    ),
                ],
                ..Item::new(
                    "bootloader",
                    s(&p["file"], "bootloader.products[].file")?,
                    v.to_string(),
                    s(&p["sha256"], "bootloader.products[].sha256")?,
                )
            });
        }
    }
    // The NPU stand-in is built from this commit; a supplied library is one of the inputs.
    let npu = &m["npu_runtime"];
    if npu["from"] == "rknn-standin" {
        out.push(Item {
            purl: Some(format!("pkg:generic/rknn-standin@{commit}")),
            license: ours(),
            facts: vec![("kiln:path".into(), s(&npu["path"], "npu_runtime.path")?)],
            ..Item::new(
                "npu-runtime",
                "rknn-standin".into(),
                commit.clone(),
                s(&npu["sha256"], "npu_runtime.sha256")?,
            )
        });
    }
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
        let g = &f["gguf"];
        out.push(Item {
            purl: Some(format!("pkg:generic/{name}?checksum=sha256:{sha}")),
            license: License::of(g["general.license"].as_str(), model_license),
            facts: gguf_facts(g),
            ..Item::new(kind, name, sha[..12.min(sha.len())].to_string(), sha)
        });
    }
    // The tools root's packages: they shape the image's bytes (mkfs, the kernel's compiler) but
    // none of them is in it.
    for d in m["tools_root"]["debs"].as_array().into_iter().flatten() {
        let name = s(&d["name"], "tools_root.debs[].name")?;
        let version = s(&d["version"], "tools_root.debs[].version")?;
        let arch = s(&d["arch"], "tools_root.debs[].arch")?;
        let sha = s(&d["sha256"], "tools_root.debs[].sha256")?;
        out.push(Item {
            purl: Some(deb_purl(
                &name,
                &version,
                &arch,
                d["distro"].as_str().unwrap_or(crate::pins::DEFAULT_DISTRO),
            )),
            facts: vec![(
                "kiln:build-tool".into(),
                "tools root (images/tools-root.toml): used to build the image, not in it".into(),
            )],
            ..Item::new("build-tool", name, version, sha)
        });
    }
    // The crates of kiln (and of the stand-in), sorted by the image step.
    for c in m["crates"].as_array().into_iter().flatten() {
        let name = s(&c["name"], "crates[].name")?;
        let version = s(&c["version"], "crates[].version")?;
        let source = s(&c["source"], "crates[].source")?;
        let linked = c["linked"]
            .as_bool()
            .context("manifest: crates[].linked is not a bool")?;
        let mut part_of = Vec::new();
        for r in c["in"].as_array().into_iter().flatten() {
            part_of.push(match r.as_str() {
                Some("kiln-runtime") => "kiln",
                Some("rknn-standin") => "npu-runtime",
                _ => bail!("manifest: crate {name} is in {r}, which is no artifact of the image"),
            });
        }
        let mut facts = vec![("kiln:crate-source".to_string(), source.clone())];
        let sha256 = c["crate_sha256"].as_str().map(str::to_string);
        if sha256.is_some() {
            facts.push((
                "kiln:sha256-of".into(),
                ".crate file (Cargo.lock checksum)".into(),
            ));
        }
        facts.push((
            "kiln:linked".into(),
            if linked {
                "yes: compiled into the binary"
            } else {
                "no: runs at compile time only (proc-macro)"
            }
            .into(),
        ));
        if let Some(l) = c["license"].as_str() {
            facts.push(("cargo:license".into(), l.to_string()));
        }
        out.push(Item {
            kind: "rust-crate",
            purl: Some(format!("pkg:cargo/{name}@{version}")),
            license: License::of(c["license"].as_str(), crates::spdx_expression),
            sha256,
            cpe: None,
            facts,
            part_of,
            linked,
            name,
            version,
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

/// What an SBOM describes: its root element. Everything below the root is the same for both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Root {
    /// The disk image `kiln-<board>.img`, with its sha256 (the manifest's `image.sha256`): the
    /// documents beside the image.
    Image,
    /// The system on the card, `kiln-<board> system`, with no hash: the documents on the boot
    /// partition (`kiln/sbom/`), which the image contains and so cannot name the image's hash.
    /// Made from the boot manifest, which has no `image`.
    System,
}

/// The root element of a document: ids, name, and the hash it has.
struct RootOf {
    spdx_id: &'static str,
    bom_ref: &'static str,
    name: String,
    sha256: Option<String>,
    /// Appended to the SPDX namespace and the CycloneDX serial seed: two documents, two ids.
    suffix: &'static str,
}

impl Root {
    fn of(self, m: &Value, board: &str) -> Result<RootOf> {
        Ok(match self {
            Root::Image => RootOf {
                spdx_id: "SPDXRef-image",
                bom_ref: "image",
                name: format!("kiln-{board}.img"),
                sha256: Some(s(&m["image"]["sha256"], "image.sha256")?),
                suffix: "",
            },
            Root::System => RootOf {
                spdx_id: "SPDXRef-system",
                bom_ref: "system",
                name: format!("kiln-{board} system"),
                sha256: None,
                suffix: "/system",
            },
        })
    }

    /// Where the documents of this root are written, for a board: beside the image
    /// (`kiln-<board>.<ext>`), or `kiln/sbom/kiln-<board>.<ext>` on the boot partition.
    pub fn file_names(self, board: &str) -> [String; 2] {
        let dir = match self {
            Root::Image => "",
            Root::System => "kiln/sbom/",
        };
        [
            format!("{dir}kiln-{board}.spdx.json"),
            format!("{dir}kiln-{board}.cdx.json"),
        ]
    }
}

/// The SPDX 2.3 document of a manifest, rooted at `root`.
pub fn spdx(m: &Value, root: Root) -> Result<Value> {
    let its = items(m)?;
    let board = s(&m["board"], "board")?;
    let commit = s(&m["commit"], "commit")?;
    let r = root.of(m, &board)?;
    let root_id = r.spdx_id;
    let mut top = json!({
        "SPDXID": root_id,
        "name": r.name,
        "versionInfo": commit,
        "downloadLocation": "NOASSERTION",
        "filesAnalyzed": false,
        "licenseConcluded": "NOASSERTION",
        "licenseDeclared": "NOASSERTION",
        "copyrightText": "NOASSERTION",
        "primaryPackagePurpose": "OPERATING-SYSTEM",
    });
    if let Some(h) = &r.sha256 {
        top["checksums"] = json!([{"algorithm": "SHA256", "checksumValue": h}]);
    }
    let mut packages = vec![top];
    let mut rels = vec![json!({
        "spdxElementId": "SPDXRef-DOCUMENT", "relationshipType": "DESCRIBES",
        "relatedSpdxElement": root_id,
    })];
    let ids: Vec<String> = its
        .iter()
        .enumerate()
        .map(|(n, it)| spdx_id(n, it))
        .collect();
    let id_of_kind = |kind: &str| -> Result<&String> {
        its.iter()
            .position(|x| x.kind == kind)
            .map(|n| &ids[n])
            .with_context(|| format!("manifest: a crate is in the {kind}, which it does not have"))
    };
    for (it, id) in its.iter().zip(&ids) {
        let id = id.clone();
        let mut refs = Vec::new();
        if let Some(p) = &it.purl {
            refs.push(json!({"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl", "referenceLocator": p}));
        }
        if let Some(c) = &it.cpe {
            refs.push(json!({"referenceCategory": "SECURITY", "referenceType": "cpe23Type", "referenceLocator": c}));
        }
        let mut comment = format!("kiln kind: {}", it.kind);
        for (k, v) in &it.facts {
            comment.push_str(&format!("; {k}: {v}"));
        }
        let mut p = json!({
            "SPDXID": id,
            "name": it.name,
            "versionInfo": it.version,
            "downloadLocation": "NOASSERTION",
            "filesAnalyzed": false,
            "licenseConcluded": "NOASSERTION",
            "licenseDeclared": it.license.spdx(),
            "copyrightText": "NOASSERTION",
            "externalRefs": refs,
            "comment": comment,
        });
        if let Some(h) = &it.sha256 {
            p["checksums"] = json!([{"algorithm": "SHA256", "checksumValue": h}]);
        }
        match it.kind {
            "rust-crate" => {
                p["primaryPackagePurpose"] = json!("LIBRARY");
                if it.sha256.is_some() {
                    p["downloadLocation"] = json!(format!(
                        "https://crates.io/api/v1/crates/{}/{}/download",
                        it.name, it.version
                    ));
                }
            }
            // A GGUF file: SPDX 2.3 has no purpose for a model.
            "model" => p["primaryPackagePurpose"] = json!("FILE"),
            // A file pinned by URL and sha256: where it is fetched from.
            "url-input" => {
                if let Some((_, u)) = it.facts.iter().find(|(k, _)| k == "kiln:url") {
                    p["downloadLocation"] = json!(u);
                }
            }
            _ => {}
        }
        packages.push(p);
        if it.kind == "rust-crate" {
            // DEPENDS_ON: the crate is compiled into the artifact (statically), transitively;
            // a compile-time-only crate is a BUILD_DEPENDENCY_OF it instead.
            for of in &it.part_of {
                let art = id_of_kind(of)?.clone();
                rels.push(if it.linked {
                    json!({"spdxElementId": art, "relationshipType": "DEPENDS_ON", "relatedSpdxElement": id})
                } else {
                    json!({"spdxElementId": id, "relationshipType": "BUILD_DEPENDENCY_OF", "relatedSpdxElement": art})
                });
            }
            continue;
        }
        let (a, t, b) = match it.kind {
            "kernel-source" => (id, "GENERATED_FROM", "SPDXRef-kernel".to_string()),
            // "A BUILD_TOOL_OF B": A is used to build B.
            "build-tool" => (id, "BUILD_TOOL_OF", root_id.to_string()),
            _ => (root_id.to_string(), "CONTAINS", id),
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
        "documentNamespace": format!("https://kiln.invalid/spdx/{board}/{commit}{}", r.suffix),
        "creationInfo": {"created": created(m)?, "creators": ["Tool: kiln-xtask"]},
        "packages": packages,
        "relationships": rels,
    }))
}

/// A UUID-shaped serial number from the board and commit (not random: same commit, same bytes),
/// and the root's suffix (the documents on the card are other documents).
fn serial(board: &str, commit: &str, suffix: &str) -> String {
    use sha2::{Digest, Sha256};
    let h = Sha256::digest(format!("kiln-sbom:{board}:{commit}{suffix}").as_bytes());
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

/// The CycloneDX 1.6 document of a manifest, rooted at `root`.
pub fn cyclonedx(m: &Value, root: Root) -> Result<Value> {
    let its = items(m)?;
    let board = s(&m["board"], "board")?;
    let commit = s(&m["commit"], "commit")?;
    let r = root.of(m, &board)?;
    let refs: Vec<String> = its
        .iter()
        .enumerate()
        .map(|(n, it)| spdx_id(n, it))
        .collect();
    let (mut comps, mut tools) = (Vec::new(), Vec::new());
    for (it, r) in its.iter().zip(&refs) {
        let ty = match it.kind {
            "debian-package" | "rust-crate" => "library",
            "build-tool" => "application",
            "kernel-source" | "kiln" | "npu-runtime" => "application",
            "kernel" => "operating-system",
            "bootloader" => "firmware",
            "url-input" => "file",
            "model" => "machine-learning-model",
            _ => "data",
        };
        let mut props = vec![json!({"name": "kiln:kind", "value": it.kind})];
        props.extend(it.facts.iter().map(|(k, v)| json!({"name": k, "value": v})));
        let mut c = json!({
            "type": ty,
            "bom-ref": r,
            "name": it.name,
            "version": it.version,
            "properties": props,
        });
        if let Some(h) = &it.sha256 {
            c["hashes"] = json!([{"alg": "SHA-256", "content": h}]);
        }
        if let Some(p) = &it.purl {
            c["purl"] = json!(p);
        }
        if let Some(x) = &it.cpe {
            c["cpe"] = json!(x);
        }
        if let Some(l) = it.license.cyclonedx() {
            c["licenses"] = l;
        }
        if let Some((_, u)) = it.facts.iter().find(|(k, _)| k == "kiln:url") {
            c["externalReferences"] = json!([{"type": "distribution", "url": u}]);
        }
        if it.kind == "rust-crate" {
            // `excluded`: in CycloneDX's words, used for non-runtime purposes (compile time).
            c["scope"] = json!(if it.linked { "required" } else { "excluded" });
        }
        // What the file says of itself; nothing beyond it is claimed.
        let arch = it
            .facts
            .iter()
            .find(|(k, _)| k == "gguf:general.architecture");
        if let (true, Some((_, a))) = (it.kind == "model", arch) {
            c["modelCard"] = json!({"modelParameters": {"architectureFamily": a}});
        }
        if it.kind == "build-tool" {
            tools.push(c);
        } else {
            comps.push(c);
        }
    }
    let of = |kind: &str| -> Vec<&String> {
        its.iter()
            .zip(&refs)
            .filter(|(it, _)| it.part_of.contains(&kind))
            .map(|(_, r)| r)
            .collect()
    };
    let mut deps = vec![json!({"ref": r.bom_ref, "dependsOn": its.iter().zip(&refs)
        .filter(|(it, _)| !matches!(it.kind, "rust-crate" | "build-tool")).map(|(_, r)| r).collect::<Vec<_>>()})];
    for (it, r) in its.iter().zip(&refs) {
        if matches!(it.kind, "kiln" | "npu-runtime") {
            deps.push(json!({"ref": r, "dependsOn": of(it.kind)}));
        }
    }
    let mut top = json!({
        "type": "firmware", "bom-ref": r.bom_ref, "name": r.name, "version": commit,
    });
    if let Some(h) = &r.sha256 {
        top["hashes"] = json!([{"alg": "SHA-256", "content": h}]);
    }
    let mut bom = json!({
        "bomFormat": "CycloneDX",
        "specVersion": "1.6",
        "serialNumber": serial(&board, &commit, r.suffix),
        "version": 1,
        "metadata": {
            "timestamp": created(m)?,
            "component": top,
        },
        "components": comps,
        "dependencies": deps,
    });
    if !tools.is_empty() {
        // How the image was made, not what it holds: the tools root as one formula.
        bom["formulation"] = json!([{
            "bom-ref": "formula-tools-root",
            "components": tools,
            "properties": [{"name": "kiln:tools-root-key", "value": m["tools_root"]["key"].as_str().unwrap_or_default()}],
        }]);
    }
    Ok(bom)
}

/// The SPDX 2.3 and CycloneDX 1.6 documents of a manifest, rooted at `root`, as the files hold
/// them (in the order of [`Root::file_names`]).
pub fn documents(m: &Value, root: Root) -> Result<[Vec<u8>; 2]> {
    Ok([
        serde_json::to_vec_pretty(&spdx(m, root)?)?,
        serde_json::to_vec_pretty(&cyclonedx(m, root)?)?,
    ])
}

/// This module's source: part of the image's SBOM step key, so that a change to what the SBOMs
/// say makes them again.
pub const SOURCE: &str = include_str!("sbom.rs");

/// Write the SBOMs of the manifest at `manifest` (the published one, with `image`) into its
/// directory; returns the paths written.
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
        crate::atomic::write_atomic(&p, &serde_json::to_vec_pretty(&spdx(&m, Root::Image)?)?)?;
        out.push(p);
    }
    if cd {
        let p = dir.join(format!("kiln-{board}.cdx.json"));
        crate::atomic::write_atomic(
            &p,
            &serde_json::to_vec_pretty(&cyclonedx(&m, Root::Image)?)?,
        )?;
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
                {"name": "libc6", "version": "2.36-9+deb12u14", "sha256": "01f4", "source": "debian libc6:arm64=2.36-9+deb12u14",
                 "license": "NOASSERTION", "license_reason": "not DEP-5 (no Format: header)"},
                {"name": "zlib1g", "version": "1:1.2.13.dfsg-1", "sha256": "7a3b", "source": "debian zlib1g:arm64=1:1.2.13.dfsg-1",
                 "license": "Zlib"},
                {"name": "linux-source-6.1", "version": "6.1.192-3", "sha256": "5259", "source": "debian linux-source-6.1:all=6.1.192-3",
                 "license": "NOASSERTION", "license_reason": "unmapped licence name GPL-2+-or-X11"},
            ],
            "tools_root": {"key": "c0de", "packages": 2, "debs": [
                {"name": "erofs-utils", "version": "1.5-1", "arch": "amd64", "sha256": "e50f"},
                {"name": "gcc-12-aarch64-linux-gnu", "version": "12.2.0-14cross1", "arch": "amd64", "sha256": "9cc1"},
            ]},
            "kernel": {"release": "6.1.192-kiln", "image_sha256": "4596"},
            "runtime": {"sha256": "d6e5"},
            "npu_runtime": {"path": "/usr/lib/librknnrt.so", "from": "rknn-standin", "sha256": "d1cb"},
            "crates": [
                {"name": "half", "version": "2.7.1", "source": "crates.io", "crate_sha256": "6ea2",
                 "license": "MIT OR Apache-2.0", "linked": true, "in": ["kiln-runtime", "rknn-standin"]},
                {"name": "old", "version": "0.1.0", "source": "crates.io", "crate_sha256": "01d0",
                 "license": "MIT/Apache-2.0", "linked": true, "in": ["kiln-runtime"]},
                {"name": "serde_derive", "version": "1.0.229", "source": "crates.io", "crate_sha256": "5e4d",
                 "license": "Some Licence", "linked": false, "in": ["kiln-runtime"]},
            ],
            "models": [{"name": "m.gguf", "sha256": "9a9a", "gguf": {
                "general.name": "SmolLM2 135M Instruct", "general.architecture": "llama",
                "general.license": "apache-2.0", "general.file_type": 3,
                "file_type_name": "MOSTLY_Q4_1", "tensor_types": {"F32": 61, "Q4_1": 210},
            }}],
            "fixture": {"name": "kiln-selftest.gguf", "sha256": "5b20"},
            "fixtures": [{"name": "kiln-llama-fixture.gguf", "sha256": "081e"}],
            "image": {"sha256": "aa1e"},
        })
    }

    #[test]
    fn sbom_has_every_manifest_entry_and_nothing_else() {
        let m = manifest();
        // SPDX: every entry, the tools root's packages among them; CycloneDX's components:
        // all but the build tools, which are in its formulation.
        let in_image = [
            "01f4", "7a3b", "5259", "4596", "d6e5", "d1cb", "9a9a", "5b20", "081e",
        ];
        let (tools, crates) = (["e50f", "9cc1"], ["6ea2", "01d0", "5e4d"]);
        let want: Vec<&str> = [&in_image[..], &tools, &crates].concat();
        let sp = spdx(&m, Root::Image).unwrap();
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
        let cd = cyclonedx(&m, Root::Image).unwrap();
        let got: Vec<&str> = cd["components"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["hashes"][0]["content"].as_str().unwrap())
            .collect();
        assert_eq!(got, [&in_image[..], &crates].concat());
        let formula = cd["formulation"].as_array().unwrap();
        assert_eq!(formula.len(), 1);
        let got: Vec<&str> = formula[0]["components"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["hashes"][0]["content"].as_str().unwrap())
            .collect();
        assert_eq!(got, tools);
        assert_eq!(
            cd["components"][0]["purl"],
            "pkg:deb/debian/libc6@2.36-9%2Bdeb12u14?arch=arm64&distro=debian-12"
        );
        assert_eq!(
            cd["components"][3]["cpe"],
            "cpe:2.3:o:linux:linux_kernel:6.1.192:*:*:*:*:*:*:*"
        );
    }

    /// A package of another Debian release, pinned under an input name that is not its package
    /// name, and a file pinned by URL: the purl names the package and its release, the URL is
    /// where the file is downloaded from.
    #[test]
    fn purls_name_the_package_and_its_release_and_urls_their_location() {
        let mut m = manifest();
        m["inputs"].as_array_mut().unwrap().extend([
            json!({"name": "linux-image-arm64", "version": "6.12.118-1", "sha256": "e432",
                   "source": "debian linux-image-6.12.118+deb13-arm64:arm64=6.12.118-1", "distro": "debian-13"}),
            json!({"name": "rkbin-license", "version": "f43a462e", "sha256": "d276",
                   "source": "url https://github.com/rockchip-linux/rkbin/raw/f43a462e/LICENSE"}),
        ]);
        let cd = cyclonedx(&m, Root::Image).unwrap();
        let comps = cd["components"].as_array().unwrap();
        let comp = |n: &str| comps.iter().find(|c| c["name"] == n).unwrap();
        assert_eq!(
            comp("linux-image-arm64")["purl"],
            "pkg:deb/debian/linux-image-6.12.118%2Bdeb13-arm64@6.12.118-1?arch=arm64&distro=debian-13"
        );
        assert_eq!(
            comp("libc6")["purl"],
            "pkg:deb/debian/libc6@2.36-9%2Bdeb12u14?arch=arm64&distro=debian-12"
        );
        let url = "https://github.com/rockchip-linux/rkbin/raw/f43a462e/LICENSE";
        assert_eq!(comp("rkbin-license")["externalReferences"][0]["url"], url);
        let sp = spdx(&m, Root::Image).unwrap();
        let pkgs = sp["packages"].as_array().unwrap();
        let pkg = |n: &str| pkgs.iter().find(|p| p["name"] == n).unwrap();
        assert_eq!(pkg("rkbin-license")["downloadLocation"], url);
        assert_eq!(pkg("libc6")["downloadLocation"], "NOASSERTION");
    }

    #[test]
    fn debian_packages_carry_their_dep5_licences() {
        let m = manifest();
        let sp = spdx(&m, Root::Image).unwrap();
        let pkgs = sp["packages"].as_array().unwrap();
        let pkg = |n: &str| pkgs.iter().find(|p| p["name"] == n).unwrap();
        assert_eq!(pkg("zlib1g")["licenseDeclared"], "Zlib");
        assert_eq!(pkg("zlib1g")["licenseConcluded"], "NOASSERTION");
        assert_eq!(pkg("libc6")["licenseDeclared"], "NOASSERTION");
        assert!(pkg("libc6")["comment"]
            .as_str()
            .unwrap()
            .contains("kiln:license-noassertion: not DEP-5 (no Format: header)"));
        assert_eq!(pkg("linux-source-6.1")["licenseDeclared"], "NOASSERTION");
        let cd = cyclonedx(&m, Root::Image).unwrap();
        let comps = cd["components"].as_array().unwrap();
        let comp = |n: &str| comps.iter().find(|c| c["name"] == n).unwrap();
        assert_eq!(comp("zlib1g")["licenses"], json!([{"expression": "Zlib"}]));
        assert_eq!(
            comp("zlib1g")["purl"],
            "pkg:deb/debian/zlib1g@1%3A1.2.13.dfsg-1?arch=arm64&distro=debian-12"
        );
        // NOASSERTION: no licence claimed, the reason as a property.
        assert!(comp("libc6").get("licenses").is_none());
        assert!(comp("linux-source-6.1")["properties"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == "kiln:license-noassertion"
                && p["value"] == "unmapped licence name GPL-2+-or-X11"));
    }

    #[test]
    fn tools_root_packages_are_build_tools_of_the_image() {
        let m = manifest();
        let sp = spdx(&m, Root::Image).unwrap();
        let pkgs = sp["packages"].as_array().unwrap();
        let erofs = pkgs.iter().find(|p| p["name"] == "erofs-utils").unwrap();
        assert_eq!(
            erofs["externalRefs"][0]["referenceLocator"],
            "pkg:deb/debian/erofs-utils@1.5-1?arch=amd64&distro=debian-12"
        );
        let rels = sp["relationships"].as_array().unwrap();
        let about: Vec<&Value> = rels
            .iter()
            .filter(|r| {
                r["spdxElementId"] == erofs["SPDXID"] || r["relatedSpdxElement"] == erofs["SPDXID"]
            })
            .collect();
        assert_eq!(
            about,
            [
                &json!({"spdxElementId": erofs["SPDXID"], "relationshipType": "BUILD_TOOL_OF",
                     "relatedSpdxElement": "SPDXRef-image"})
            ]
        );
        let cd = cyclonedx(&m, Root::Image).unwrap();
        assert!(!cd["components"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["name"] == "erofs-utils"));
        let tool = &cd["formulation"][0]["components"][0];
        assert_eq!(tool["name"], "erofs-utils");
        assert_eq!(tool["hashes"][0]["content"], "e50f");
        assert_eq!(
            tool["purl"],
            "pkg:deb/debian/erofs-utils@1.5-1?arch=amd64&distro=debian-12"
        );
        let image_deps = cd["dependencies"][0]["dependsOn"].as_array().unwrap();
        assert!(!image_deps.contains(&tool["bom-ref"]));
        // A manifest of before the tools root was listed has no formulation.
        let mut old = m.clone();
        old["tools_root"] = json!({"key": "c0de", "packages": 2});
        assert!(cyclonedx(&old, Root::Image)
            .unwrap()
            .get("formulation")
            .is_none());
    }

    #[test]
    fn crates_have_cargo_purls_licences_and_relationships() {
        let m = manifest();
        let sp = spdx(&m, Root::Image).unwrap();
        let pkgs = sp["packages"].as_array().unwrap();
        let pkg = |n: &str| pkgs.iter().find(|p| p["name"] == n).unwrap();
        let half = pkg("half");
        assert_eq!(
            half["externalRefs"][0]["referenceLocator"],
            "pkg:cargo/half@2.7.1"
        );
        assert_eq!(half["licenseDeclared"], "MIT OR Apache-2.0");
        assert_eq!(half["licenseConcluded"], "NOASSERTION");
        assert_eq!(pkg("old")["licenseDeclared"], "MIT OR Apache-2.0");
        assert_eq!(pkg("serde_derive")["licenseDeclared"], "NOASSERTION");
        // kiln and the stand-in: the workspace's licence.
        assert_eq!(pkg("kiln")["licenseDeclared"], "MIT OR Apache-2.0");
        assert_eq!(pkg("rknn-standin")["licenseDeclared"], "MIT OR Apache-2.0");
        assert!(half["comment"]
            .as_str()
            .unwrap()
            .contains(".crate file (Cargo.lock checksum)"));
        let (kiln, npu, half_id, sd) = (
            pkg("kiln")["SPDXID"].clone(),
            pkg("rknn-standin")["SPDXID"].clone(),
            half["SPDXID"].clone(),
            pkg("serde_derive")["SPDXID"].clone(),
        );
        let rels = sp["relationships"].as_array().unwrap();
        let has = |a: &Value, t: &str, b: &Value| {
            rels.iter().any(|r| {
                r["spdxElementId"] == *a
                    && r["relationshipType"] == t
                    && r["relatedSpdxElement"] == *b
            })
        };
        assert!(has(&kiln, "DEPENDS_ON", &half_id));
        assert!(has(&npu, "DEPENDS_ON", &half_id));
        assert!(has(&sd, "BUILD_DEPENDENCY_OF", &kiln));
        assert!(!rels
            .iter()
            .any(|r| r["relatedSpdxElement"] == half_id && r["spdxElementId"] == "SPDXRef-image"));

        let cd = cyclonedx(&m, Root::Image).unwrap();
        let comps = cd["components"].as_array().unwrap();
        let comp = |n: &str| comps.iter().find(|c| c["name"] == n).unwrap();
        assert_eq!(comp("half")["purl"], "pkg:cargo/half@2.7.1");
        assert_eq!(comp("half")["type"], "library");
        assert_eq!(comp("half")["scope"], "required");
        assert_eq!(
            comp("half")["licenses"],
            json!([{"expression": "MIT OR Apache-2.0"}])
        );
        assert_eq!(comp("serde_derive")["scope"], "excluded");
        assert_eq!(
            comp("serde_derive")["licenses"],
            json!([{"license": {"name": "Some Licence"}}])
        );
        let deps = cd["dependencies"].as_array().unwrap();
        let image = &deps[0]["dependsOn"];
        assert!(!image.as_array().unwrap().contains(&comp("half")["bom-ref"]));
        let kiln_deps = deps
            .iter()
            .find(|d| d["ref"] == comp("kiln")["bom-ref"])
            .unwrap();
        assert_eq!(kiln_deps["dependsOn"].as_array().unwrap().len(), 3);
    }

    #[test]
    fn models_carry_their_gguf_metadata() {
        let m = manifest();
        let cd = cyclonedx(&m, Root::Image).unwrap();
        let c = cd["components"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == "m.gguf")
            .unwrap();
        assert_eq!(c["type"], "machine-learning-model");
        assert_eq!(c["licenses"], json!([{"expression": "Apache-2.0"}]));
        assert_eq!(
            c["modelCard"]["modelParameters"]["architectureFamily"],
            "llama"
        );
        let props = c["properties"].as_array().unwrap();
        for (k, v) in [
            ("gguf:general.name", "SmolLM2 135M Instruct"),
            ("gguf:file_type_name", "MOSTLY_Q4_1"),
            ("gguf:general.file_type", "3"),
            ("gguf:tensor_types.Q4_1", "210"),
        ] {
            assert!(
                props.iter().any(|p| p["name"] == k && p["value"] == v),
                "{k}={v}: {props:?}"
            );
        }
        let sp = spdx(&m, Root::Image).unwrap();
        let p = sp["packages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == "m.gguf")
            .unwrap();
        assert_eq!(p["licenseDeclared"], "Apache-2.0");
        assert_eq!(p["primaryPackagePurpose"], "FILE");
        // A fixture without metadata gets no licence and no model card.
        let f = cd["components"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == "kiln-selftest.gguf")
            .unwrap();
        assert_eq!(f["type"], "data");
        assert!(f.get("licenses").is_none() && f.get("modelCard").is_none());
        assert_eq!(model_license("Apache-2.0").unwrap(), "Apache-2.0");
        assert_eq!(model_license("llama3.2"), None);
    }

    /// The documents on the card: made from the boot manifest (no `image`), rooted at the
    /// system (no hash, its own ids), and otherwise the documents beside the image.
    #[test]
    fn card_documents_are_the_image_ones_with_the_system_as_root() {
        let m = manifest();
        let mut boot = m.clone();
        boot.as_object_mut().unwrap().remove("image");
        assert!(
            spdx(&boot, Root::Image).is_err(),
            "a boot manifest has no image hash"
        );
        let (a, b) = (
            spdx(&m, Root::Image).unwrap(),
            spdx(&boot, Root::System).unwrap(),
        );
        let root = &b["packages"][0];
        assert_eq!(root["SPDXID"], "SPDXRef-system");
        assert_eq!(root["name"], "kiln-qemu-virt system");
        assert_eq!(root["versionInfo"], m["commit"]);
        assert_eq!(root["primaryPackagePurpose"], "OPERATING-SYSTEM");
        assert!(root.get("checksums").is_none());
        assert_eq!(a["packages"][0]["checksums"][0]["checksumValue"], "aa1e");
        assert_eq!(
            b["documentNamespace"],
            format!("{}/system", a["documentNamespace"].as_str().unwrap())
        );
        assert_eq!(
            a["packages"].as_array().unwrap()[1..],
            b["packages"].as_array().unwrap()[1..]
        );
        let as_image = |v: &Value| {
            serde_json::from_str::<Value>(
                &v.to_string()
                    .replace("\"SPDXRef-system\"", "\"SPDXRef-image\""),
            )
            .unwrap()
        };
        assert_eq!(a["relationships"], as_image(&b["relationships"]));
        for k in [
            "spdxVersion",
            "dataLicense",
            "SPDXID",
            "name",
            "creationInfo",
        ] {
            assert_eq!(a[k], b[k], "{k}");
        }
        assert_eq!(a.as_object().unwrap().len(), b.as_object().unwrap().len());

        let (a, b) = (
            cyclonedx(&m, Root::Image).unwrap(),
            cyclonedx(&boot, Root::System).unwrap(),
        );
        assert_eq!(
            b["metadata"]["component"],
            json!({"type": "firmware", "bom-ref": "system", "name": "kiln-qemu-virt system",
                   "version": m["commit"]})
        );
        assert_eq!(a["metadata"]["component"]["hashes"][0]["content"], "aa1e");
        assert_eq!(a["metadata"]["timestamp"], b["metadata"]["timestamp"]);
        assert_ne!(a["serialNumber"], b["serialNumber"]);
        assert_eq!(a["components"], b["components"]);
        assert_eq!(a["formulation"], b["formulation"]);
        let mut deps = b["dependencies"].clone();
        assert_eq!(deps[0]["ref"], "system");
        deps[0]["ref"] = json!("image");
        assert_eq!(a["dependencies"], deps);
        assert_eq!(a.as_object().unwrap().len(), b.as_object().unwrap().len());
        // Deterministic, and the same whether the manifest has an image or not.
        assert_eq!(
            documents(&boot, Root::System).unwrap(),
            documents(&m, Root::System).unwrap()
        );
        assert_eq!(
            Root::System.file_names("qemu-virt"),
            [
                "kiln/sbom/kiln-qemu-virt.spdx.json",
                "kiln/sbom/kiln-qemu-virt.cdx.json"
            ]
        );
    }

    #[test]
    fn sbom_is_deterministic_and_dated_from_the_manifest() {
        let m = manifest();
        let a = serde_json::to_vec_pretty(&spdx(&m, Root::Image).unwrap()).unwrap();
        assert_eq!(
            a,
            serde_json::to_vec_pretty(&spdx(&m, Root::Image).unwrap()).unwrap()
        );
        assert_eq!(
            spdx(&m, Root::Image).unwrap()["creationInfo"]["created"],
            "2026-12-03T15:43:02Z"
        );
        assert_eq!(time_of(0), "1970-01-01T00:00:00Z");
        assert_eq!(time_of(951782400), "2000-02-29T00:00:00Z");
        let mut m2 = m.clone();
        m2["commit"] = json!("0000000000000000000000000000000000000000");
        assert_ne!(
            cyclonedx(&m, Root::Image).unwrap()["serialNumber"],
            cyclonedx(&m2, Root::Image).unwrap()["serialNumber"]
        );
    }
}
