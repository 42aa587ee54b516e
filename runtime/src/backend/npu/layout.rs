//! Weight conversion for the NPU: GGUF rows (W as N rows of K) into RK3588's native B layout,
//! with Q8_0 requantised to one symmetric int8 scale per output channel.

use anyhow::{bail, Result};
use half::f16;

/// (subN, subK) of RK3588's native B layout: fp16 (N/16, K/32, 16, 32), int8 (N/32, K/32, 32, 32).
/// Only the expected value: the tile kiln converts with is the one the library reports
/// (`io_attr.B.dims[2..4]`), and a library that reports another is declined.
pub fn sub_tile(int8: bool) -> (usize, usize) {
    if int8 {
        (32, 32)
    } else {
        (16, 32)
    }
}

/// Index of B element (k, n) in the native layout of a K×N block with K ≤ 8192 (one segment;
/// kiln splits larger K into separate contexts, so segments never arise).
pub fn native_index(k: usize, n: usize, kk: usize, sub_n: usize, sub_k: usize) -> usize {
    (((n / sub_n) * (kk / sub_k) + k / sub_k) * sub_n + n % sub_n) * sub_k + k % sub_k
}

/// Q8_0 block: f16 scale then 32 int8 quants.
const Q8_0_BLOCK: usize = 34;

/// Row `n` of a Q8_0 weight with `k` columns, dequantised (ggml: `x = d · q`).
pub fn q8_0_row(data: &[u8], k: usize, n: usize) -> Result<Vec<f32>> {
    let row_bytes = k / 32 * Q8_0_BLOCK;
    let Some(row) = data.get(n * row_bytes..(n + 1) * row_bytes) else {
        bail!(
            "Q8_0 row {n} is past the end of the weight's {} bytes",
            data.len()
        );
    };
    let mut out = Vec::with_capacity(k);
    for b in row.chunks_exact(Q8_0_BLOCK) {
        let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
        out.extend(b[2..].iter().map(|q| d * (*q as i8) as f32));
    }
    Ok(out)
}

/// Symmetric int8 over a whole vector: (quants, scale) with `x ≈ q · scale`.
pub fn quantize_sym(x: &[f32]) -> (Vec<i8>, f32) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 || !amax.is_finite() {
        return (vec![0; x.len()], if amax == 0.0 { 0.0 } else { f32::NAN });
    }
    let scale = amax / 127.0;
    let inv = 1.0 / scale;
    let q = x
        .iter()
        .map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8)
        .collect();
    (q, scale)
}

/// The block of columns `k0..k0+kc` and rows `n0..n0+nc` of W in native B layout with the tile
/// `(sub_n, sub_k)` the library reported. `rows[n]` is row n of W (K values) as the element
/// type's little-endian bytes.
pub fn pack_native(
    rows: &[Vec<u8>],
    elem: usize,
    tile: (usize, usize),
    k: (usize, usize),
    n: (usize, usize),
) -> Vec<u8> {
    let mut out = vec![0u8; k.1 * n.1 * elem];
    pack_native_into(&mut out, rows, elem, tile, k, n);
    out
}

/// [`pack_native`] into `out` (exactly `kc · nc · elem` bytes; the B buffer itself).
pub fn pack_native_into(
    out: &mut [u8],
    rows: &[Vec<u8>],
    elem: usize,
    (sub_n, sub_k): (usize, usize),
    (k0, kc): (usize, usize),
    (n0, nc): (usize, usize),
) {
    for nn in 0..nc {
        let row = &rows[n0 + nn];
        for kk in 0..kc {
            let to = native_index(kk, nn, kc, sub_n, sub_k) * elem;
            let from = (k0 + kk) * elem;
            out[to..to + elem].copy_from_slice(&row[from..from + elem]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn native_layout_round_trips() {
        for int8 in [false, true] {
            let (k, n) = (64, if int8 { 64 } else { 32 });
            let rows: Vec<Vec<u8>> = (0..n)
                .map(|r| (0..k).map(|c| (r * k + c) as u8).collect())
                .collect();
            let (sn, sk) = sub_tile(int8);
            let packed = pack_native(&rows, 1, (sn, sk), (0, k), (0, n));
            for (r, row) in rows.iter().enumerate() {
                for (c, v) in row.iter().enumerate() {
                    assert_eq!(packed[native_index(c, r, k, sn, sk)], *v);
                }
            }
            // The header's first run: K1..K32 of N1, then K1..K32 of N2.
            assert_eq!(&packed[..32], &rows[0][..32]);
            assert_eq!(&packed[32..64], &rows[1][..32]);
        }
    }

    #[test]
    fn quantize_sym_keeps_amax() {
        let (q, s) = quantize_sym(&[0.5, -1.27, 0.0]);
        assert_eq!(q, [50, -127, 0]);
        assert!((s - 0.01).abs() < 1e-7);
        assert_eq!(quantize_sym(&[0.0; 4]), (vec![0; 4], 0.0));
    }
}
