//! The ownership ledger: for each backend, which weights it owns and how their bytes arrived.
//!
//! Field lesson (`context/experiment-2026-10-11.txt`): ownership must be a positive line that
//! names the mechanism, because "owned via a multi-GiB memcpy" and "owned via an mmap window"
//! otherwise print the same word. So every backend gets one line, always, with the copied bytes
//! spelled out even when they are zero.

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// How a weight's bytes reached the backend that owns it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Arrival {
    /// A view into the model mapping: no byte moved.
    Borrowed,
    /// Rewritten into a backend's own layout (the NPU's native B layout): `bytes` produced.
    Converted { bytes: u64 },
    /// Copied as-is into memory the backend allocated. The thing the ledger exists to catch.
    Copied { bytes: u64 },
}

#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct BackendTotals {
    /// Weights owned by this backend.
    pub tensors: usize,
    /// Weights of those that are views into the mapping.
    pub mapped_tensors: usize,
    /// Bytes of the owned weights as they lie in the file.
    pub file_bytes: u64,
    pub converted_bytes: u64,
    pub copied_bytes: u64,
    pub copied_tensors: Vec<String>,
}

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Ledger {
    backends: BTreeMap<String, BackendTotals>,
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

impl Ledger {
    pub fn new() -> Ledger {
        Ledger::default()
    }

    /// Record that `backend` owns `tensor` (`file_bytes` long in the file), arrived as `arrival`.
    pub fn record(&mut self, backend: &str, tensor: &str, file_bytes: u64, arrival: Arrival) {
        let t = self.backends.entry(backend.to_string()).or_default();
        t.tensors += 1;
        t.file_bytes += file_bytes;
        match arrival {
            Arrival::Borrowed => t.mapped_tensors += 1,
            Arrival::Converted { bytes } => t.converted_bytes += bytes,
            Arrival::Copied { bytes } => {
                t.copied_bytes += bytes;
                t.copied_tensors.push(tensor.to_string());
            }
        }
    }

    pub fn totals(&self, backend: &str) -> Option<&BackendTotals> {
        self.backends.get(backend)
    }

    pub fn backends(&self) -> impl Iterator<Item = (&str, &BackendTotals)> {
        self.backends.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// One positive line per backend, e.g.
    /// `weights on CPU via mmap (zero-copy, borrowed): 98.36 MiB (mapped 272/272 tensors, copied 0.00 MiB)`.
    pub fn lines(&self) -> Vec<String> {
        self.backends
            .iter()
            .map(|(name, t)| {
                let how = if t.copied_bytes > 0 {
                    "via copy (NOT zero-copy)"
                } else if t.converted_bytes > 0 && t.mapped_tensors == 0 {
                    "via mmap, converted to native layout"
                } else if t.converted_bytes > 0 {
                    "via mmap (zero-copy, borrowed) and converted to native layout"
                } else {
                    "via mmap (zero-copy, borrowed)"
                };
                let mut line = format!(
                    "weights on {name} {how}: {:.2} MiB (mapped {}/{} tensors, copied {:.2} MiB",
                    mib(t.file_bytes),
                    t.mapped_tensors,
                    t.tensors,
                    mib(t.copied_bytes)
                );
                if t.converted_bytes > 0 {
                    let _ = write!(line, ", converted {:.2} MiB", mib(t.converted_bytes));
                }
                line.push(')');
                line
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn borrowed_weights_print_the_zero_copy_line() {
        let mut l = Ledger::new();
        l.record("CPU", "a", 3 * 1024 * 1024, Arrival::Borrowed);
        l.record("CPU", "b", 1024 * 1024, Arrival::Borrowed);
        assert_eq!(
            l.lines(),
            ["weights on CPU via mmap (zero-copy, borrowed): 4.00 MiB (mapped 2/2 tensors, copied 0.00 MiB)"]
        );
    }

    #[test]
    fn a_copy_is_named_not_hidden() {
        let mut l = Ledger::new();
        l.record("CPU", "a", 1024 * 1024, Arrival::Borrowed);
        l.record(
            "CPU",
            "b",
            2 * 1024 * 1024,
            Arrival::Copied {
                bytes: 2 * 1024 * 1024,
            },
        );
        let line = &l.lines()[0];
        assert!(line.contains("NOT zero-copy"), "{line}");
        assert!(
            line.contains("mapped 1/2 tensors, copied 2.00 MiB"),
            "{line}"
        );
        assert_eq!(l.totals("CPU").unwrap().copied_tensors, ["b"]);
    }

    #[test]
    fn npu_conversion_is_counted_separately() {
        let mut l = Ledger::new();
        l.record(
            "NPU",
            "w",
            1024 * 1024,
            Arrival::Converted {
                bytes: 2 * 1024 * 1024,
            },
        );
        assert_eq!(
            l.lines(),
            ["weights on NPU via mmap, converted to native layout: 1.00 MiB (mapped 0/1 tensors, copied 0.00 MiB, converted 2.00 MiB)"]
        );
    }
}
