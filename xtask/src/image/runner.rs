//! The step runner of the image pipeline: what every step shares. A step is a product (one or
//! more files) with the key of everything it is made from; the runner reuses it when its files
//! exist and its recorded key is the same, otherwise makes it into temporary names and publishes
//! it under the final names, then records the key (so a half-made product is never reused). It
//! times every step, logs one line each, and counts them for the summary.

use crate::atomic::write_atomic;
use crate::pins::Sha256;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The key file of a made step: the key, then the sha256 of each output as it was published.
fn record(key: &Sha256, outputs: &[PathBuf]) -> Result<String> {
    let mut r = format!("{key}\n");
    for o in outputs {
        r.push_str(&format!("{}  {}\n", Sha256::of_file_memo(o)?, o.display()));
    }
    Ok(r)
}

/// Whether a step's products are still the ones it made under `key`: the recorded key is the
/// same and every output still has the sha256 recorded when it was published. A product changed
/// since (an image booted with `cargo xtask qemu --persist`, a file edited by hand) is remade,
/// not reused under a hash it no longer has. Hashes come through the memo ([`crate::pins::memo`]), so
/// an unchanged file costs a stat, not a read.
fn still_made(recorded: &str, key: &Sha256, outputs: &[PathBuf]) -> bool {
    let mut lines = recorded.lines();
    if lines.next() != Some(key.to_string().as_str()) {
        return false;
    }
    let hashes: Vec<&str> = lines.map(|l| l.split("  ").next().unwrap_or("")).collect();
    hashes.len() == outputs.len()
        && outputs
            .iter()
            .zip(hashes)
            .all(|(o, h)| Sha256::of_file_memo(o).is_ok_and(|got| got.to_string() == h))
}

/// One product: its name, the key of its inputs, its files, and how to make them. `make` writes
/// each output to the temporary path it is handed (same order as `outputs`) and returns a short
/// description of what it made, for the log.
pub struct Step<'a> {
    pub name: &'static str,
    pub key: Sha256,
    pub outputs: Vec<PathBuf>,
    pub make: Make<'a>,
}

/// How a step makes its outputs: temporary paths in, a line for the log out.
pub type Make<'a> = Box<dyn FnOnce(&[PathBuf]) -> Result<String> + 'a>;

/// A step's product under its final names, and the key it was made from.
pub struct Product {
    pub paths: Vec<PathBuf>,
    pub key: Sha256,
}

impl Product {
    pub fn path(&self) -> &Path {
        &self.paths[0]
    }
}

/// The key of a step: its inputs, one per line (the first names the step and its format version).
pub fn key_of(parts: &[&str]) -> Sha256 {
    Sha256::of_bytes(parts.join("\n").as_bytes())
}

/// What became of one step.
pub struct Done {
    pub name: String,
    pub reused: bool,
    pub seconds: f64,
}

pub struct Runner {
    t0: Instant,
    /// Where the keys are recorded (`<name>.key`).
    keys: PathBuf,
    pub done: Vec<Done>,
}

impl Runner {
    pub fn new(keys: &Path) -> Result<Runner> {
        std::fs::create_dir_all(keys).with_context(|| format!("creating {}", keys.display()))?;
        Ok(Runner {
            t0: Instant::now(),
            keys: keys.to_path_buf(),
            done: Vec::new(),
        })
    }

    pub fn say(&self, msg: &str) {
        println!("image: [{:>6.1} s] {msg}", self.t0.elapsed().as_secs_f64());
    }

    pub fn elapsed(&self) -> f64 {
        self.t0.elapsed().as_secs_f64()
    }

    fn key_file(&self, step: &str) -> PathBuf {
        self.keys.join(format!("{}.key", step.replace(' ', "-")))
    }

    /// Reuse or make `step`; see the module comment.
    pub fn run(&mut self, step: Step) -> Result<Product> {
        let t = Instant::now();
        let key_file = self
            .keys
            .join(format!("{}.key", step.name.replace(' ', "-")));
        let recorded = std::fs::read_to_string(&key_file).ok();
        let fresh = recorded
            .as_deref()
            .is_some_and(|r| still_made(r, &step.key, &step.outputs));
        if fresh {
            self.say(&format!("reused {} (key {})", step.name, step.key.short()));
        } else {
            if key_file.exists() {
                std::fs::remove_file(&key_file)
                    .with_context(|| format!("removing {}", key_file.display()))?;
            }
            let temps: Vec<PathBuf> = step.outputs.iter().map(|p| partial(p)).collect();
            for p in &temps {
                let _ = std::fs::remove_file(p);
            }
            let made = (step.make)(&temps).with_context(|| format!("image step {}", step.name));
            let detail = match made {
                Ok(d) => d,
                Err(e) => {
                    for p in &temps {
                        let _ = std::fs::remove_file(p);
                    }
                    return Err(e);
                }
            };
            for (tmp, out) in temps.iter().zip(&step.outputs) {
                std::fs::rename(tmp, out).with_context(|| {
                    format!(
                        "step {}: {} did not make {}",
                        step.name,
                        tmp.display(),
                        out.display()
                    )
                })?;
            }
            write_atomic(&key_file, record(&step.key, &step.outputs)?.as_bytes())?;
            self.say(&format!(
                "{}: {detail} ({:.1} s)",
                step.name,
                t.elapsed().as_secs_f64()
            ));
        }
        self.done.push(Done {
            name: step.name.to_string(),
            reused: fresh,
            seconds: t.elapsed().as_secs_f64(),
        });
        Ok(Product {
            paths: step.outputs,
            key: step.key,
        })
    }

    /// A step whose builder keeps its own cache (the kernel's): logged and counted here.
    pub fn record(&mut self, name: &str, reused: bool, detail: &str, started: Instant) {
        let seconds = started.elapsed().as_secs_f64();
        if reused {
            self.say(&format!("reused {name} ({detail})"));
        } else {
            self.say(&format!("{name}: {detail} ({seconds:.1} s)"));
        }
        self.done.push(Done {
            name: name.to_string(),
            reused,
            seconds,
        });
    }

    /// A step that must run to know its product (cargo's build of the runtime): `key` is the
    /// product's own hash, and the step counts as reused when it equals the recorded one.
    pub fn observed(
        &mut self,
        name: &str,
        key: &Sha256,
        detail: &str,
        started: Instant,
    ) -> Result<()> {
        let key_file = self.key_file(name);
        let same = std::fs::read_to_string(&key_file).ok().as_deref() == Some(&key.to_string());
        if !same {
            write_atomic(&key_file, key.to_string().as_bytes())?;
        }
        self.record(name, same, detail, started);
        Ok(())
    }

    /// The names of the reused steps, in order.
    pub fn reused(&self) -> Vec<String> {
        self.done
            .iter()
            .filter(|d| d.reused)
            .map(|d| d.name.clone())
            .collect()
    }

    /// The closing line: how many steps; which were made (and how long each took), which reused.
    pub fn summary(&self) {
        let made: Vec<String> = self
            .done
            .iter()
            .filter(|d| !d.reused)
            .map(|d| format!("{} {:.1} s", d.name, d.seconds))
            .collect();
        let reused = self.reused();
        let list = |v: &[String]| {
            if v.is_empty() {
                String::new()
            } else {
                format!(" ({})", v.join(", "))
            }
        };
        self.say(&format!(
            "{} steps: {} made{}, {} reused{}",
            self.done.len(),
            made.len(),
            list(&made),
            reused.len(),
            list(&reused)
        ));
    }
}

/// The temporary name a step's output is made under: hidden, beside the final one.
fn partial(out: &Path) -> PathBuf {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    out.with_file_name(format!(".{name}.partial"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step<'a>(out: &'a Path, key: &'a str, made: &'a std::cell::Cell<u32>) -> Step<'a> {
        Step {
            name: "thing",
            key: key_of(&["thing-v1", key]),
            outputs: vec![out.to_path_buf()],
            make: Box::new(move |tmp: &[PathBuf]| {
                made.set(made.get() + 1);
                assert_ne!(tmp[0], out, "made under a temporary name");
                std::fs::write(&tmp[0], key)?;
                Ok(format!("wrote {key}"))
            }),
        }
    }

    /// Made once, reused while the key is the same, remade when it changes; counted right.
    #[test]
    fn reuse_follows_the_key() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("thing.bin");
        let made = std::cell::Cell::new(0);
        let mut r = Runner::new(&d.path().join("keys")).unwrap();
        r.run(step(&out, "a", &made)).unwrap();
        r.run(step(&out, "a", &made)).unwrap();
        assert_eq!(made.get(), 1);
        r.run(step(&out, "b", &made)).unwrap();
        assert_eq!(made.get(), 2);
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "b");
        assert_eq!(r.reused(), ["thing"]);
        assert_eq!(r.done.len(), 3);
        // A product whose file is gone is remade even if its key is recorded.
        std::fs::remove_file(&out).unwrap();
        r.run(step(&out, "b", &made)).unwrap();
        assert_eq!(made.get(), 3);
        // A product changed after it was made (a booted --persist image) is remade, not reused
        // under the hash it had.
        std::fs::write(&out, "booted").unwrap();
        r.run(step(&out, "b", &made)).unwrap();
        assert_eq!(made.get(), 4);
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "b");
        // A key file of the old form (the key alone) is not trusted: remade once.
        std::fs::write(
            d.path().join("keys/thing.key"),
            key_of(&["thing-v1", "b"]).to_string(),
        )
        .unwrap();
        r.run(step(&out, "b", &made)).unwrap();
        assert_eq!(made.get(), 5);
        r.run(step(&out, "b", &made)).unwrap();
        assert_eq!(made.get(), 5);
    }

    /// A failed step leaves neither its output nor a key, and the next run makes it again.
    #[test]
    fn a_failed_step_publishes_nothing() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("thing.bin");
        let mut r = Runner::new(&d.path().join("keys")).unwrap();
        let err = r
            .run(Step {
                name: "thing",
                key: key_of(&["thing-v1", "a"]),
                outputs: vec![out.clone()],
                make: Box::new(|tmp: &[PathBuf]| {
                    std::fs::write(&tmp[0], "half")?;
                    anyhow::bail!("disk full")
                }),
            })
            .err()
            .expect("the step failed");
        assert!(format!("{err:#}").contains("image step thing: disk full"));
        assert!(!out.exists());
        assert_eq!(
            std::fs::read_dir(d.path()).unwrap().count(),
            1,
            "only keys/"
        );
        let made = std::cell::Cell::new(0);
        r.run(step(&out, "a", &made)).unwrap();
        assert_eq!(made.get(), 1);
    }
}
