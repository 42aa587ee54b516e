//! The bodies of the fuzz targets in `runtime/fuzz` (cargo-fuzz on nightly), shared with their
//! seeded run on stable (`tests/fuzz_seeded.rs`, part of `cargo test`): one function per target,
//! which panics when one of the target's invariants breaks. Not an API.

pub mod chat_template;
#[cfg(feature = "net")]
pub mod serve_request;

/// A deterministic mutation of `seed` (byte flips, deletions, insertions of `dict` tokens and of
/// structural bytes, duplications), as libFuzzer's mutators do, for the seeded run: `rng` is a
/// SplitMix64 state, so a fixed seed gives the same inputs on every machine.
pub fn mutate(seed: &[u8], dict: &[&[u8]], rng: &mut u64) -> Vec<u8> {
    let mut next = || {
        *rng = rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut b = seed.to_vec();
    for _ in 0..1 + next() % 6 {
        let pos = if b.is_empty() {
            0
        } else {
            (next() % b.len() as u64) as usize
        };
        match next() % 6 {
            0 if !b.is_empty() => b[pos] = next() as u8,
            1 if !b.is_empty() => {
                let n = 1 + (next() % 8) as usize;
                b.drain(pos..(pos + n).min(b.len()));
            }
            2 if !dict.is_empty() => {
                let t = dict[(next() % dict.len() as u64) as usize];
                b.splice(pos..pos, t.iter().copied());
            }
            3 if !b.is_empty() => {
                // A slice of the input again, elsewhere (repetition, nesting).
                let n = 1 + (next() % 64) as usize;
                let piece = b[pos..(pos + n).min(b.len())].to_vec();
                let at = (next() % (b.len() as u64 + 1)) as usize;
                b.splice(at..at, piece);
            }
            4 if !b.is_empty() => b.truncate(pos),
            _ => {
                const BYTES: &[u8] = b"{}[]\",:0123456789-eE.tfn\\u \r\n\0%|'()";
                let c = BYTES[(next() % BYTES.len() as u64) as usize];
                b.insert(pos.min(b.len()), c);
            }
        }
    }
    b
}
