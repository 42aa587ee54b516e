//! Sequential read bandwidth, the ceiling a memory-bound decode is measured against: one
//! measurement for `kiln bench` and `cargo bench --bench matmul` alike. (The self-check's
//! `memory.bandwidth` has its own, bounded to 0.2 s.)

use std::time::Instant;

/// Bytes per second read by `threads` threads summing disjoint parts of a 256 MiB buffer (far
/// past the caches): the best of five passes after one warm-up.
pub fn read_bandwidth(threads: usize) -> f64 {
    let words: usize = 32 << 20; // 256 MiB of u64
    let buf: Vec<u64> = (0..words as u64).collect();
    let per = words.div_ceil(threads.max(1));
    let mut best = f64::MAX;
    for pass in 0..6 {
        let t = Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = buf
                .chunks(per)
                .map(|c| {
                    s.spawn(move || {
                        // Independent sums so the adds do not serialise on one register.
                        let mut acc = [0u64; 8];
                        for ch in c.chunks_exact(8) {
                            for l in 0..8 {
                                acc[l] = acc[l].wrapping_add(ch[l]);
                            }
                        }
                        acc.iter().fold(0u64, |a, &b| a.wrapping_add(b))
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or(0))
                .fold(0u64, u64::wrapping_add)
        });
        std::hint::black_box(total);
        if pass > 0 {
            best = best.min(t.elapsed().as_secs_f64());
        }
    }
    (words * 8) as f64 / best
}
