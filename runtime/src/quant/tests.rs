//! Golden blocks, built byte by byte from ggml's struct layouts, with the expected values worked
//! out by hand in the comments.

use super::dequant::f16_at;
use super::*;
use half::{bf16, f16};

fn h(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_le_bytes()
}

fn deq(ty: GgmlType, src: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; n];
    dequantize_row(ty, src, &mut out).unwrap_or_else(|e| panic!("{ty}: {e}"));
    out
}

#[test]
fn f32_f16_bf16_golden() {
    let mut src = Vec::new();
    src.extend(1.5f32.to_le_bytes());
    src.extend((-2.0f32).to_le_bytes());
    assert_eq!(deq(GgmlType::F32, &src, 2), [1.5, -2.0]);
    // 0x3C00 = 1.0, 0xC000 = −2.0, 0x3555 = 0.333251953125 (binary16).
    let src = [0x00, 0x3C, 0x00, 0xC0, 0x55, 0x35];
    assert_eq!(deq(GgmlType::F16, &src, 3), [1.0, -2.0, 0.333_251_95]);
    // bf16 is the top half of an f32: 0x3F80 = 1.0, 0xC0A0 = −5.0, 0x3F81 = 1.0078125.
    let src = [0x80, 0x3F, 0xA0, 0xC0, 0x81, 0x3F];
    assert_eq!(deq(GgmlType::Bf16, &src, 3), [1.0, -5.0, 1.007_812_5]);
    assert_eq!(bf16::from_f32(1.0078125).to_bits(), 0x3F81);
}

#[test]
fn q8_0_golden() {
    let mut b = vec![0u8; 34];
    b[..2].copy_from_slice(&h(0.5));
    b[2] = 1;
    b[3] = (-2i8) as u8;
    b[4] = 127;
    b[5] = (-128i8) as u8;
    let y = deq(GgmlType::Q8_0, &b, 32);
    assert_eq!(&y[..5], &[0.5, -1.0, 63.5, -64.0, 0.0]);
}

#[test]
fn q4_0_golden_and_nibble_order() {
    let mut b = vec![0x88u8; 18]; // 0x88: both nibbles 8, i.e. zero
    b[..2].copy_from_slice(&h(2.0));
    b[2] = 0x1F; // element 0 = (15−8)·2 = 14, element 16 = (1−8)·2 = −14
    b[3] = 0x80; // element 1 = (0−8)·2 = −16, element 17 = (8−8)·2 = 0
    let y = deq(GgmlType::Q4_0, &b, 32);
    let mut want = [0.0f32; 32];
    want[0] = 14.0;
    want[16] = -14.0;
    want[1] = -16.0;
    assert_eq!(y, want);

    // Negative check: adjacent-pair nibble order (element 2j low, 2j+1 high), the classic
    // mistake, decodes the same bytes differently, so the golden above tells the two apart.
    let d = 2.0f32;
    let wrong: Vec<f32> = b[2..]
        .iter()
        .flat_map(|q| [((q & 0xF) as f32 - 8.0) * d, ((q >> 4) as f32 - 8.0) * d])
        .collect();
    assert_ne!(wrong, y);
    assert_eq!(
        wrong[1], -14.0,
        "adjacent order puts element 16's nibble at 1"
    );
}

#[test]
fn q4_1_golden() {
    let mut b = vec![0u8; 20];
    b[..2].copy_from_slice(&h(0.5));
    b[2..4].copy_from_slice(&h(-1.0));
    b[4] = 0x3A; // element 0 = 10·0.5 − 1 = 4, element 16 = 3·0.5 − 1 = 0.5
    let y = deq(GgmlType::Q4_1, &b, 32);
    assert_eq!(y[0], 4.0);
    assert_eq!(y[16], 0.5);
    assert_eq!(y[1], -1.0);
    assert_eq!(y[31], -1.0);
}

#[test]
fn q5_0_golden() {
    let mut b = vec![0u8; 22];
    b[..2].copy_from_slice(&h(1.0));
    // qh bit j is element j's 5th bit: set for elements 0 and 16 and 31.
    b[2..6].copy_from_slice(&((1u32 << 0) | (1 << 16) | (1 << 31)).to_le_bytes());
    b[6] = 0x21; // element 0 = (1|16)−16 = 1, element 16 = (2|16)−16 = 2
    b[7] = 0x0F; // element 1 = 15−16 = −1, element 17 = 0−16 = −16
    b[21] = 0xF0; // element 15 = 0−16 = −16, element 31 = (15|16)−16 = 15
    let y = deq(GgmlType::Q5_0, &b, 32);
    assert_eq!(
        [y[0], y[16], y[1], y[17], y[15], y[31]],
        [1.0, 2.0, -1.0, -16.0, -16.0, 15.0]
    );
}

#[test]
fn q5_1_golden() {
    let mut b = vec![0u8; 24];
    b[..2].copy_from_slice(&h(0.25));
    b[2..4].copy_from_slice(&h(1.0));
    b[4..8].copy_from_slice(&(1u32 << 31).to_le_bytes());
    b[8 + 15] = 0x50; // element 15 = 0·0.25 + 1 = 1, element 31 = (5|16)·0.25 + 1 = 6.25
    b[8] = 0x0F; // element 0 = 15·0.25 + 1 = 4.75, element 16 = 1
    let y = deq(GgmlType::Q5_1, &b, 32);
    assert_eq!([y[15], y[31], y[0], y[16]], [1.0, 6.25, 4.75, 1.0]);
}

/// The 12 scale bytes of the K-quant goldens below:
/// sc0 = 2, m0 = 3, sc1 = 5, m1 = 1, sc2 = 3, m2 = 0; sub-block 4 takes its high bits from the top
/// two bits of s[0] (sc) and s[4] (m): sc4 = (0x73 & 0xF) | (1 << 4) = 19, m4 = 0x73 >> 4 = 7.
fn k_scales() -> [u8; 12] {
    let mut s = [0u8; 12];
    s[0] = 2 | (1 << 6);
    s[4] = 3;
    s[1] = 5;
    s[5] = 1;
    s[2] = 3;
    s[8] = 0x73;
    s
}

#[test]
fn get_scale_min_k4_golden() {
    let s = k_scales();
    assert_eq!(get_scale_min_k4(0, &s), (2, 3));
    assert_eq!(get_scale_min_k4(1, &s), (5, 1));
    assert_eq!(get_scale_min_k4(2, &s), (3, 0));
    assert_eq!(get_scale_min_k4(4, &s), (19, 7));
    assert_eq!(get_scale_min_k4(5, &s), (0, 0));
    // All 6 bits reachable for i ≥ 4: low 4 from s[i+4], high 2 from s[i−4] / s[i].
    let s = [0xFFu8; 12];
    assert_eq!(get_scale_min_k4(7, &s), (63, 63));
}

#[test]
fn q4_k_golden() {
    let mut b = vec![0u8; 144];
    b[..2].copy_from_slice(&h(1.0));
    b[2..4].copy_from_slice(&h(0.5));
    b[4..16].copy_from_slice(&k_scales());
    b[16] = 0x94; // element 0: 1·2·4 − 0.5·3 = 6.5; element 32: 1·5·9 − 0.5·1 = 44.5
    b[16 + 64] = 0x0A; // element 128 (chunk 2, low nibble, sub-block 4): 19·10 − 0.5·7 = 186.5
    let y = deq(GgmlType::Q4K, &b, 256);
    assert_eq!(y[0], 6.5);
    assert_eq!(y[32], 44.5);
    assert_eq!(y[1], -1.5); // q = 0: just −dmin·m0
    assert_eq!(y[128], 186.5);
    assert_eq!(y[160], 0.0); // sub-block 5: sc = m = 0
}

#[test]
fn q5_k_golden() {
    let mut b = vec![0u8; 176];
    b[..2].copy_from_slice(&h(1.0));
    b[2..4].copy_from_slice(&h(1.0));
    b[4..16].copy_from_slice(&k_scales());
    // qh[l] bit 2c adds 16 to element 64c+l, bit 2c+1 to element 64c+32+l.
    b[16] = 0b11;
    b[16 + 1] = 0b100;
    b[48] = 0x21; // element 0 = 2·(1+16) − 3 = 31; element 32 = 5·(2+16) − 1 = 89
    let y = deq(GgmlType::Q5K, &b, 256);
    assert_eq!(y[0], 31.0);
    assert_eq!(y[32], 89.0);
    assert_eq!(y[65], 3.0 * 16.0); // sub-block 2, q = 0 | 16
    assert_eq!(y[64], 0.0);
    assert_eq!(y[1], -3.0);
}

#[test]
fn q6_k_golden_d_is_last() {
    let mut b = vec![0u8; 210];
    b[208..210].copy_from_slice(&h(0.5)); // d is the last field
    let sc: [i8; 16] = [2, 0, -1, 0, 3, 0, 1, 0, 4, 0, 0, 0, 0, 0, 0, 0];
    for (i, s) in sc.iter().enumerate() {
        b[192 + i] = *s as u8;
    }
    b[0] = 0x35; // ql[0]: element 0 low nibble 5, element 64 high nibble 3
    b[32] = 0x07; // ql[32]: element 32 low nibble 7, element 96 high nibble 0
    b[128] = 0b11_00_10_01; // qh[0]: 2-bit highs of elements 0, 32, 64, 96
    let y = deq(GgmlType::Q6K, &b, 256);
    assert_eq!(y[0], 0.5 * 2.0 * ((5 | 16) - 32) as f32); // −11
    assert_eq!(y[32], -0.5 * ((7 | 32) - 32) as f32); // d·sc = 0.5·(−1); −3.5
    assert_eq!(y[64], 0.5 * 3.0 * (3 - 32) as f32); // −43.5
    assert_eq!(y[96], 0.5 * 1.0 * (48 - 32) as f32); // 8
    assert_eq!(y[128], 0.5 * 4.0 * -32.0); // second half: sc[8], q = 0 − 32
    assert_eq!(y[16], 0.0); // is = 1: sc[1] = 0
    assert_eq!(
        [y[0], y[32], y[64], y[96], y[128]],
        [-11.0, -3.5, -43.5, 8.0, -64.0]
    );
}

#[test]
fn length_and_type_errors_name_what_was_wrong() {
    let mut out = [0.0f32; 32];
    assert_eq!(
        dequantize_row(GgmlType::Q4_0, &[0u8; 17], &mut out),
        Err(QuantError::LengthMismatch {
            ty: GgmlType::Q4_0,
            elems: 32,
            expected: 18,
            actual: 17
        })
    );
    assert_eq!(
        dequantize_row(GgmlType::Q2K, &[0u8; 84], &mut [0.0; 256]),
        Err(QuantError::Unsupported(GgmlType::Q2K))
    );
    assert!(matches!(
        dequantize_row(GgmlType::Q8_0, &[0u8; 34], &mut [0.0; 31]),
        Err(QuantError::PartialBlock { .. })
    ));
    let msg = QuantError::LengthMismatch {
        ty: GgmlType::Q6K,
        elems: 256,
        expected: 210,
        actual: 200,
    }
    .to_string();
    assert!(
        msg.contains("210") && msg.contains("200") && msg.contains("Q6_K"),
        "{msg}"
    );
}

#[test]
fn q8_0_quantizer_rounds_half_away_from_zero() {
    let mut x = [0.0f32; 32];
    x[0] = 31.75; // amax → d = 31.75/127 = 0.25 exactly, 1/d = 4
    x[1] = -0.375; // −1.5 → −2
    x[2] = 0.125; // 0.5 → 1
    x[3] = 0.625; // 2.5 → 3 (ties away, not to even)
    let b = q8_0_block(&x);
    assert_eq!(b.d, f16::from_f32(0.25));
    assert_eq!(&b.qs[..5], &[127, -2, 1, 3, 0]);
    let bytes = quantize_to_vec(GgmlType::Q8_0, &x).unwrap();
    assert_eq!(&bytes[..2], &h(0.25));
    assert_eq!(bytes[3], (-2i8) as u8);
    let q1 = q8_1_block(&x);
    assert_eq!(q1.qs, b.qs);
    assert_eq!(q1.s, f16::from_f32((127 - 2 + 1 + 3) as f32 * 0.25));
    assert_eq!(quantize_to_vec(GgmlType::Q8_1, &x).unwrap().len(), 36);
}

#[test]
fn q8_k_quantizer_golden() {
    let mut x = [0.0f32; 256];
    x[0] = -63.5; // the value of largest magnitude, negative: iscale = −127/−63.5 = 2
    x[1] = 0.25; // 0.5 → 0 (nearest, ties to even)
    x[2] = 0.75; // 1.5 → 2
    x[3] = 1.25; // 2.5 → 2
    x[4] = 63.5; // same magnitude, found later: 127
    x[17] = -1.0; // −2, in the second 16-sum
    let b = q8_k_block(&x);
    assert_eq!(b.d, 0.5);
    assert_eq!(&b.qs[..5], &[-127, 0, 2, 2, 127]);
    assert_eq!(b.bsums[0], -127 + 2 + 2 + 127);
    assert_eq!(b.bsums[1], -2);
    let bytes = quantize_to_vec(GgmlType::Q8K, &x).unwrap();
    assert_eq!(bytes.len(), 292);
    assert_eq!(&bytes[..4], &0.5f32.to_le_bytes());
    assert_eq!(&bytes[4 + 256..4 + 258], &4i16.to_le_bytes());
}

#[test]
fn q4_0_and_q5_0_quantizers_golden() {
    let mut x = [0.0f32; 32];
    x[0] = -4.0; // signed absmax: d = −4/−8 = 0.5, 1/d = 2 → q = trunc(−8 + 8.5) = 0
    x[1] = 3.5; // 7 + 8.5 → 15
    x[16] = 0.3; // 0.6 + 8.5 → 9
    let b = quantize_to_vec(GgmlType::Q4_0, &x).unwrap();
    assert_eq!(&b[..2], &h(0.5));
    assert_eq!(b[2], 9 << 4); // element 0 low (0), element 16 high (9)
    assert_eq!(b[3], 0x8F); // element 1 = 15, element 17 = 8 (zero)
    let y = deq(GgmlType::Q4_0, &b, 32);
    assert_eq!([y[0], y[1], y[16]], [-4.0, 3.5, 0.5]);

    let b = quantize_to_vec(GgmlType::Q5_0, &x).unwrap();
    // d = −4/−16 = 0.25, 1/d = 4: element 0 → trunc(−16 + 16.5) = 0, element 1 → 14 + 16.5 → 30
    assert_eq!(&b[..2], &h(0.25));
    let y = deq(GgmlType::Q5_0, &b, 32);
    assert_eq!([y[0], y[1], y[2]], [-4.0, 3.5, 0.0]);
}

/// Quantise then dequantise with every reference quantiser: each element lands within half a
/// step of the input (the step is the block's d), so layout and quantiser agree.
#[test]
fn quantizers_round_trip_within_half_a_step() {
    let x: Vec<f32> = (0..256)
        .map(|i| (i as f32 * 0.37).sin() * 3.0 + (i % 7) as f32 * 0.1)
        .collect();
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
    ] {
        let b = quantize_to_vec(ty, &x).unwrap();
        let y = deq(ty, &b, x.len());
        let (be, bb) = ty.block();
        for (blk, (xs, ys)) in x.chunks(be).zip(y.chunks(be)).enumerate() {
            let d = f16_at(&b, blk * bb).abs();
            for (a, r) in xs.iter().zip(ys) {
                // Half a step, plus the f16 rounding of d and m.
                let tol = d * 0.5 + 0.02;
                assert!((a - r).abs() <= tol, "{ty} block {blk}: {a} vs {r} (d {d})");
            }
        }
    }
}

/// Values where a rounding can go wrong: ±0, ±∞, NaN, the extremes, each integer k of `ks`
/// and k + 0.5 of both signs with their neighbours one ulp away, and a stride through all 2³²
/// bit patterns.
fn rounding_edges(ks: impl IntoIterator<Item = i32>) -> Vec<f32> {
    let mut vals = vec![
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -0.0,
        0.0,
        f32::MAX,
        f32::MIN,
    ];
    for k in ks {
        let half = k as f32 + 0.5;
        for v in [k as f32, half, -half] {
            vals.extend([
                v,
                f32::from_bits(v.to_bits() + 1),
                f32::from_bits(v.to_bits().max(1) - 1),
            ]);
        }
    }
    vals.extend((0..=u32::MAX).step_by(4099).map(f32::from_bits));
    vals
}

/// The activation quantiser's rounding is `f32::round` then a saturating cast, for every kind of
/// value: halves of both signs, the neighbours of each half, the ±127 edge, values past i8 and
/// past i32, infinities, NaN, and a stride through all 2³² bit patterns.
#[test]
fn round_i8_is_round_half_away_then_saturate() {
    let mut vals = rounding_edges(-300..=300);
    vals.extend([8388607.5, 8388608.0, 2147483520.0, 2147483648.0, 3e9, -3e9]);
    for v in vals {
        assert_eq!(
            super::quantize::round_i8(v),
            v.round() as i8,
            "{v:e} ({:#x})",
            v.to_bits()
        );
    }
}

/// The row quantiser the fast path uses (AVX2 on x86 hosts that have it, NEON on aarch64) gives
/// the reference blocks' values bit for bit: random rows at many magnitudes, ties (amax 31.75
/// makes 1/d = 4, so eighths land on halves), zeros, subnormals (1/d overflows to ∞),
/// infinities and NaN. A quantiser that rounds ties to even, or lets a NaN into the maximum,
/// fails it.
#[test]
fn q8_row_equals_the_reference_blocks() {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut x: Vec<f32> = Vec::new();
    for b in 0..4000 {
        let scale = [1e-30f32, 1e-3, 0.1, 1.0, 3.0, 1e3, 1e30][b % 7];
        x.extend((0..32).map(|_| ((next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * scale));
    }
    let mut ties = [0.0f32; 32];
    ties[0] = 31.75;
    for (j, t) in ties.iter_mut().enumerate().skip(1) {
        *t = (j as f32 - 16.0) / 8.0;
    }
    x.extend(ties);
    x.extend(ties.map(|v| -v));
    x.extend([0.0f32; 32]);
    x.extend([f32::from_bits(1); 32]);
    let mut odd = [1.0f32; 32];
    odd[3] = f32::NAN;
    odd[9] = f32::from_bits(3);
    x.extend(odd);
    odd[5] = f32::INFINITY;
    odd[6] = f32::NEG_INFINITY;
    x.extend(odd);
    odd = [f32::NAN; 32];
    x.extend(odd);
    odd[0] = 2.5e-44;
    odd[1] = -1e-45;
    x.extend(odd);
    let n = x.len() / 32;
    let (mut qs, mut d, mut s) = (vec![0i8; x.len()], vec![0.0f32; n], vec![0.0f32; n]);
    super::quantize::q8_row(&x, &mut qs, &mut d, Some(&mut s));
    let (mut qs0, mut d0) = (vec![0i8; x.len()], vec![0.0f32; n]);
    super::quantize::q8_row(&x, &mut qs0, &mut d0, None);
    for (b, blk) in x.chunks_exact(32).enumerate() {
        let blk: &[f32; 32] = blk.try_into().unwrap();
        let want = q8_1_block(blk);
        let got = &qs[b * 32..(b + 1) * 32];
        assert_eq!(got, &want.qs[..], "block {b}: {blk:?}");
        assert_eq!(d[b].to_bits(), want.d.to_f32().to_bits(), "block {b} d");
        assert_eq!(s[b].to_bits(), want.s.to_f32().to_bits(), "block {b} s");
        let want0 = q8_0_block(blk);
        assert_eq!(
            &qs0[b * 32..(b + 1) * 32],
            &want0.qs[..],
            "block {b} (Q8_0)"
        );
        assert_eq!(
            d0[b].to_bits(),
            want0.d.to_f32().to_bits(),
            "block {b} d (Q8_0)"
        );
    }
}

/// ggml's magic-number `nearest_int` equals `round_ties_even` for every f32 (ties, their
/// neighbours, the range edge 4194303 and beyond, ±0, infinities, NaN, and a stride through all
/// bit patterns).
#[test]
fn nearest_int_is_round_ties_even() {
    let vals = rounding_edges(
        (-300i32..=300).chain([4_194_302, 4_194_303, 4_194_304, -4_194_303, -4_194_304]),
    );
    for v in vals {
        assert_eq!(
            super::quantize::nearest_int(v),
            v.round_ties_even() as i32,
            "{v:e} ({:#x})",
            v.to_bits()
        );
    }
}
