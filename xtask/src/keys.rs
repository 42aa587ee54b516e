//! `cargo xtask keys new --out DIR`: a fleet's own update keys, outside the checkout. A CA
//! (`fleet-ca.pem`, the certificate a recipe names as `[update] keyring`, and its key) and a
//! signing certificate it issued (`signing-cert.pem` + `signing-key.pem`, what `cargo xtask
//! bundle --key --cert` signs with). EC P-256, made by `rcgen` (pure Rust: no OpenSSL on the
//! host, the same on every Linux). Valid from 1970-01-01 to 9999-12-31 like the development
//! certificate, since a board may boot with its clock unset; a key is retired by rotation (a new
//! signing certificate from the same CA) or, for the CA itself, by a new keyring in an update.
//!
//! Keys are never written into the checkout (a key in a repository is a key anyone can read) nor
//! over existing files; private keys are mode 0600.

use anyhow::{bail, Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair, KeyUsagePurpose,
    PKCS_ECDSA_P256_SHA256,
};
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub what: What,
}

#[derive(clap::Subcommand)]
pub enum What {
    /// A new CA and a signing certificate it issued, written to DIR (outside the checkout).
    New {
        /// Where to write the four files (created; must not hold them already).
        #[arg(long)]
        out: PathBuf,
        /// The fleet's name, in the certificates' subjects.
        #[arg(long, default_value = "kiln fleet")]
        name: String,
    },
    /// Revoke a signing certificate: the CA's CRL (in DIR/keyring.pem, the file the recipe
    /// names) lists it, and boards built with that keyring refuse bundles it signed.
    Revoke {
        /// The folder of `keys new` (its CA, its keyring.pem, its list of revoked serials).
        #[arg(long)]
        ca: PathBuf,
        /// The signing certificate to revoke (PEM).
        #[arg(long)]
        cert: PathBuf,
    },
    /// A new signing certificate from an existing CA (rotation): DIR/signing-{cert,key}.pem.
    Sign {
        /// The folder of `keys new` (its fleet-ca.pem and fleet-ca.key.pem).
        #[arg(long)]
        ca: PathBuf,
        /// Where to write the new signing certificate and key.
        #[arg(long)]
        out: PathBuf,
        /// The fleet's name, in the certificate's subject.
        #[arg(long, default_value = "kiln fleet")]
        name: String,
    },
}

pub const CA_CERT: &str = "fleet-ca.pem";
pub const CA_KEY: &str = "fleet-ca.key.pem";
pub const SIGNING_CERT: &str = "signing-cert.pem";
pub const SIGNING_KEY: &str = "signing-key.pem";
/// What a recipe names as `[update] keyring`: the CA and its CRL (empty until `keys revoke`).
pub const KEYRING: &str = "keyring.pem";
/// The serials `keys revoke` listed, one per line (hex), so the next CRL keeps them.
pub const REVOKED: &str = "revoked.txt";

pub fn run(args: Args) -> Result<()> {
    match args.what {
        What::New { out, name } => {
            let files = new(&out, &name)?;
            println!("keys: {}", files.join(", "));
            println!(
                "keys: in the recipe: [update] keyring = \"{}\"",
                out.join(KEYRING).display()
            );
            println!(
                "keys: sign bundles with: cargo xtask bundle --key {} --cert {}",
                out.join(SIGNING_KEY).display(),
                out.join(SIGNING_CERT).display()
            );
            println!(
                "keys: keep {} offline; a new signing certificate: cargo xtask keys sign --ca {} --out DIR",
                CA_KEY,
                out.display()
            );
            Ok(())
        }
        What::Revoke { ca, cert } => {
            let serial = revoke(&ca, &cert)?;
            println!(
                "keys: revoked {} (serial {serial}); {} now lists it: build and ship an image with \
                 it (signed by a certificate still valid) so boards refuse bundles it signed",
                cert.display(),
                ca.join(KEYRING).display()
            );
            Ok(())
        }
        What::Sign { ca, out, name } => {
            let files = sign(&ca, &out, &name)?;
            println!("keys: {}", files.join(", "));
            Ok(())
        }
    }
}

fn outside_checkout(out: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let out = std::fs::canonicalize(out).with_context(|| format!("resolving {}", out.display()))?;
    let root = std::fs::canonicalize(crate::paths::project_root())?;
    if out.starts_with(&root) {
        bail!(
            "{} is inside the checkout {}: keys there end up in a commit or an archive; give a \
             folder outside it",
            out.display(),
            root.display()
        );
    }
    Ok(out)
}

fn params(name: &str, what: &str, ca: bool) -> Result<CertificateParams> {
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, name);
    dn.push(DnType::CommonName, format!("{name} {what}"));
    p.distinguished_name = dn;
    p.not_before = rcgen::date_time_ymd(1970, 1, 1);
    p.not_after = rcgen::date_time_ymd(9999, 12, 31);
    if ca {
        p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    } else {
        p.is_ca = IsCa::ExplicitNoCa;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    }
    Ok(p)
}

/// Write `name` in `dir` (not over an existing file); `secret`: mode 0600.
fn write_new(dir: &Path, name: &str, text: &str, secret: bool) -> Result<String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(name);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(&path)
        .with_context(|| format!("writing {} (it must not exist yet)", path.display()))?;
    f.write_all(text.as_bytes())
        .and_then(|()| f.sync_all())
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path.display().to_string())
}

fn refuse_existing(dir: &Path, names: &[&str]) -> Result<()> {
    let there: Vec<&&str> = names.iter().filter(|n| dir.join(n).exists()).collect();
    if !there.is_empty() {
        bail!(
            "{} already holds {:?}: keys are never overwritten; give another folder",
            dir.display(),
            there
        );
    }
    Ok(())
}

/// A new CA and a signing certificate it issued in `out`; the paths written.
pub fn new(out: &Path, name: &str) -> Result<Vec<String>> {
    let out = outside_checkout(out)?;
    refuse_existing(&out, &[CA_CERT, CA_KEY, SIGNING_CERT, SIGNING_KEY])?;
    let ca_key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
    let ca = params(name, "update CA", true)?.self_signed(&ca_key)?;
    let mut files = vec![
        write_new(&out, CA_CERT, &ca.pem(), false)?,
        write_new(&out, CA_KEY, &ca_key.serialize_pem(), true)?,
    ];
    files.extend(issue(&out, name, &ca, &ca_key)?);
    write_keyring(&out, &ca, &ca_key, &[])?;
    files.push(out.join(KEYRING).display().to_string());
    Ok(files)
}

/// `keyring.pem`: the CA and a CRL it signed listing `revoked` (hex serials), written atomically.
/// The CRL's times span 1970-01-01 to 9999-12-31, like the certificates: a board whose clock was
/// never set still accepts it (OpenSSL checks a CRL's dates).
fn write_keyring(
    dir: &Path,
    ca: &rcgen::Certificate,
    ca_key: &KeyPair,
    revoked: &[String],
) -> Result<()> {
    use rcgen::{CertificateRevocationListParams, KeyIdMethod, RevokedCertParams, SerialNumber};
    let revoked_certs = revoked
        .iter()
        .map(|h| {
            Ok(RevokedCertParams {
                serial_number: SerialNumber::from_slice(
                    &hex::decode(h).with_context(|| format!("{REVOKED}: {h:?} is not hex"))?,
                ),
                revocation_time: rcgen::date_time_ymd(1970, 1, 1),
                reason_code: Some(rcgen::RevocationReason::KeyCompromise),
                invalidity_date: None,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let crl = CertificateRevocationListParams {
        this_update: rcgen::date_time_ymd(1970, 1, 1),
        next_update: rcgen::date_time_ymd(9999, 12, 31),
        crl_number: SerialNumber::from(revoked.len() as u64 + 1),
        issuing_distribution_point: None,
        revoked_certs,
        key_identifier_method: KeyIdMethod::Sha256,
    }
    .signed_by(ca, ca_key)?;
    let text = format!("{}{}", ca.pem(), crl.pem()?);
    crate::atomic::write_atomic(&dir.join(KEYRING), text.as_bytes())
}

/// The CA of a `keys new` folder: its certificate rebuilt from its own parameters and key (rcgen
/// signs with the issuer's name and key, so what it issues names exactly that CA).
fn load_ca(ca_dir: &Path) -> Result<(rcgen::Certificate, KeyPair)> {
    let read = |f: &str| {
        let p = ca_dir.join(f);
        std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))
    };
    let ca_key = KeyPair::from_pem(&read(CA_KEY)?).context("the CA key")?;
    let ca_params =
        CertificateParams::from_ca_cert_pem(&read(CA_CERT)?).context("the CA certificate")?;
    let ca = ca_params.self_signed(&ca_key)?;
    Ok((ca, ca_key))
}

/// Add `cert`'s serial to the CA's revoked list and write its keyring anew; the serial (hex).
pub fn revoke(ca_dir: &Path, cert: &Path) -> Result<String> {
    let (ca, ca_key) = load_ca(ca_dir)?;
    let pem =
        std::fs::read_to_string(cert).with_context(|| format!("reading {}", cert.display()))?;
    let params = CertificateParams::from_ca_cert_pem(&pem)
        .with_context(|| format!("{}: not a PEM certificate", cert.display()))?;
    let serial = hex::encode(
        params
            .serial_number
            .as_ref()
            .with_context(|| format!("{}: no serial number", cert.display()))?
            .as_ref(),
    );
    let list = ca_dir.join(REVOKED);
    let mut revoked: Vec<String> = std::fs::read_to_string(&list)
        .unwrap_or_default()
        .lines()
        .map(|l| l.trim().to_string())
        .filter(|l| !l.is_empty())
        .collect();
    if !revoked.contains(&serial) {
        revoked.push(serial.clone());
    }
    crate::atomic::write_atomic(&list, format!("{}\n", revoked.join("\n")).as_bytes())?;
    write_keyring(ca_dir, &ca, &ca_key, &revoked)?;
    Ok(serial)
}

/// A new signing certificate from the CA in `ca_dir`, written to `out`.
pub fn sign(ca_dir: &Path, out: &Path, name: &str) -> Result<Vec<String>> {
    let (ca, ca_key) = load_ca(ca_dir)?;
    let out = outside_checkout(out)?;
    refuse_existing(&out, &[SIGNING_CERT, SIGNING_KEY])?;
    issue(&out, name, &ca, &ca_key)
}

fn issue(out: &Path, name: &str, ca: &rcgen::Certificate, ca_key: &KeyPair) -> Result<Vec<String>> {
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
    let cert = params(name, "bundle signing", false)?.signed_by(&key, ca, ca_key)?;
    Ok(vec![
        write_new(out, SIGNING_CERT, &cert.pem(), false)?,
        write_new(out, SIGNING_KEY, &key.serialize_pem(), true)?,
    ])
}

/// The `boot-qemu-ab` stage's part: fleet keys against RAUC itself (the tools root's `rauc`,
/// the version the board runs). A bundle signed with a fleet's signing certificate verifies
/// against the fleet CA, and so does one from a rotated signing certificate; against the
/// development keyring (qemu-virt's) it is refused before it ships, and a bundle signed with
/// the development key does not verify against the fleet CA.
pub fn stage() -> Result<()> {
    let dir = tempfile::tempdir().context("a folder for the test fleet's keys")?;
    let fleet = dir.path().join("fleet");
    new(&fleet, "kiln test fleet")?;
    let rotated = dir.path().join("rotated");
    sign(&fleet, &rotated, "kiln test fleet")?;
    let out = crate::paths::target_dir().join("kiln/keys-test");
    std::fs::create_dir_all(&out)?;
    let bundle = |signer: Option<&Path>, keyring: Option<PathBuf>, name: &str| {
        crate::bundle::make(&crate::bundle::Args::qemu_virt(
            signer.map(|d| (d.join(SIGNING_KEY), d.join(SIGNING_CERT))),
            out.join(name),
            keyring,
        ))
    };
    let ca = Some(fleet.join(CA_CERT));
    bundle(Some(&fleet), ca.clone(), "fleet.raucb")
        .context("a bundle signed by the fleet's signing certificate, against the fleet CA")?;
    println!("keys: a bundle signed with `keys new`'s signing certificate verifies against its CA (rauc info)");
    bundle(Some(&rotated), ca.clone(), "rotated.raucb")
        .context("a bundle signed by a rotated signing certificate, against the fleet CA")?;
    println!("keys: so does one signed with `keys sign`'s new certificate from the same CA");
    match bundle(Some(&fleet), None, "refused.raucb") {
        Ok(_) => bail!("a fleet-signed bundle verified against qemu-virt's development keyring"),
        Err(e) => {
            let e = format!("{e:#}");
            anyhow::ensure!(e.contains("the board would refuse it"), "{e}");
            println!("keys: against the development keyring it is refused before it ships");
        }
    }
    match bundle(None, ca, "dev-signed.raucb") {
        Ok(_) => bail!("a bundle signed with the development key verified against the fleet CA"),
        Err(_) => println!(
            "keys: a bundle signed with the development key does not verify against the fleet CA"
        ),
    }
    // Revocation: the first signing certificate revoked, the keyring (CA + CRL) is what a board
    // built from it trusts, with check-crl as its system.conf says.
    revoke(&fleet, &fleet.join(SIGNING_CERT))?;
    let keyring = Some(fleet.join(KEYRING));
    match bundle(Some(&fleet), keyring.clone(), "revoked.raucb") {
        Ok(_) => bail!(
            "a bundle signed by a revoked certificate verified against the keyring with its CRL"
        ),
        Err(e) => {
            let e = format!("{e:#}");
            anyhow::ensure!(
                e.contains("certificate revoked"),
                "refused, but not as revoked: {e}"
            );
            println!(
                "keys: after `keys revoke`, a bundle its certificate signs is refused: certificate revoked"
            );
        }
    }
    bundle(Some(&rotated), keyring, "after-revoke.raucb")
        .context("a bundle signed by the rotated certificate after the first was revoked")?;
    println!("keys: the rotated certificate's bundles still verify");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `cargo test --workspace --bin xtask -- --ignored keys::tests::with_rauc`: [`stage`] alone
    /// (the tools root and the qemu-virt image are made or reused).
    #[test]
    #[ignore]
    fn with_rauc() {
        stage().unwrap();
    }

    #[test]
    fn keys_are_made_outside_the_checkout_and_never_over_old_ones() {
        let dir = tempfile::tempdir().unwrap();
        let files = new(dir.path(), "test fleet").unwrap();
        assert_eq!(files.len(), 5);
        let kr = std::fs::read_to_string(dir.path().join(KEYRING)).unwrap();
        assert!(kr.contains("BEGIN CERTIFICATE") && crate::image::updates::has_crl(kr.as_bytes()));
        use std::os::unix::fs::PermissionsExt;
        for (f, mode) in [(CA_KEY, 0o600), (SIGNING_KEY, 0o600), (CA_CERT, 0o644)] {
            let m = std::fs::metadata(dir.path().join(f))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(m & 0o777, mode, "{f}");
        }
        let e = new(dir.path(), "again").unwrap_err();
        assert!(format!("{e:#}").contains("never overwritten"), "{e:#}");
        let inside = crate::paths::project_root().join("target/kiln/keys-test");
        let e = new(&inside, "x").unwrap_err();
        assert!(format!("{e:#}").contains("inside the checkout"), "{e:#}");
        // Rotation: a second signing certificate from the same CA, elsewhere.
        let other = tempfile::tempdir().unwrap();
        assert_eq!(
            sign(dir.path(), other.path(), "test fleet").unwrap().len(),
            2
        );
        let a = std::fs::read_to_string(dir.path().join(SIGNING_CERT)).unwrap();
        let b = std::fs::read_to_string(other.path().join(SIGNING_CERT)).unwrap();
        assert_ne!(a, b);
    }
}
