//! Tutor's own kernel for decode-shaped products `x · Wᵀ` (a few rows `x`, a large weight
//! `W`), over weights laid out once in panels of [`WIDTH`] output columns.
//!
//! Why: MKL picks its kernels by CPU vendor. On AMD processors its `sgemm` (packed or not)
//! re-copies the weight panels on every call (`mkl_blas_def_sgemm_scopy_down16_bdz`, 43%
//! of a decode step in a perf profile on the 2026-11-22 AMD EPYC project machine), so a
//! step streams every weight twice. Here each panel is read once, straight into
//! fused multiply-adds.
//!
//! Layout: panel `p` holds, for `k` in `0..in`, the weights `W[p·WIDTH + j][k]` for `j` in
//! `0..WIDTH` side by side (the last panel zero-padded). Every output element is the sum
//! over `k` in ascending order with one fused multiply-add per term, whatever the number
//! of rows: a row's numbers never depend on the other rows of its product (a sequence's
//! tokens do not depend on its batch mates).

/// Output columns per panel (one 256-bit register of float32).
pub(crate) const WIDTH: usize = 8;

/// Rows one pass over the weights serves; larger inputs are taken in blocks of this many.
const BLOCK_ROWS: usize = 8;

/// Whether this CPU runs the kernel (x86-64 with AVX2 and FMA).
pub(crate) fn supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `w` (`[out, in]`, row-major) in panels.
pub(crate) fn pack(w: &[f32], out_dim: usize, in_dim: usize) -> Vec<f32> {
    assert_eq!(w.len(), out_dim * in_dim);
    let mut panels = vec![0f32; out_dim.div_ceil(WIDTH) * in_dim * WIDTH];
    for (o, row) in w.chunks_exact(in_dim.max(1)).enumerate().take(out_dim) {
        let (p, j) = (o / WIDTH, o % WIDTH);
        let base = p * in_dim * WIDTH;
        for (k, &v) in row.iter().enumerate() {
            panels[base + k * WIDTH + j] = v;
        }
    }
    panels
}

/// `y = x · Wᵀ`: `x` `[rows, in]` and `y` `[rows, out]`, row-major and contiguous; `panels`
/// from [`pack`] for `W` `[out, in]`.
///
/// # Safety
/// [`supported`] must be true; `x` must point to `rows · in` floats and `y` to `rows · out`.
pub(crate) unsafe fn matmul_t(
    x: *const f32,
    rows: usize,
    in_dim: usize,
    panels: &[f32],
    out_dim: usize,
    y: *mut f32,
) {
    assert_eq!(panels.len(), out_dim.div_ceil(WIDTH) * in_dim * WIDTH);
    let mut r = 0;
    while r < rows {
        let n = (rows - r).min(BLOCK_ROWS);
        let (x, y) = (x.add(r * in_dim), y.add(r * out_dim));
        #[cfg(target_arch = "x86_64")]
        match n {
            1 => avx2::block::<1, 4>(x, in_dim, panels, out_dim, y),
            2 => avx2::block::<2, 4>(x, in_dim, panels, out_dim, y),
            3 => avx2::block::<3, 2>(x, in_dim, panels, out_dim, y),
            4 => avx2::block::<4, 2>(x, in_dim, panels, out_dim, y),
            5 => avx2::block::<5, 1>(x, in_dim, panels, out_dim, y),
            6 => avx2::block::<6, 1>(x, in_dim, panels, out_dim, y),
            7 => avx2::block::<7, 1>(x, in_dim, panels, out_dim, y),
            _ => avx2::block::<8, 1>(x, in_dim, panels, out_dim, y),
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("panels are only used where `supported` holds ({n} rows)");
        r += n;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::WIDTH;
    use std::arch::x86_64::*;

    /// `R` rows (≤ 8) against every panel, `P` panels at a time (independent sums, so the
    /// fused multiply-adds of few rows still overlap; the order within a sum is the same
    /// for every `R` and `P`).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn block<const R: usize, const P: usize>(
        x: *const f32,
        in_dim: usize,
        panels: &[f32],
        out_dim: usize,
        y: *mut f32,
    ) {
        let n_panels = out_dim.div_ceil(WIDTH);
        let mut p = 0;
        while p + P <= n_panels {
            panel_group::<R, P>(x, in_dim, panels, out_dim, y, p);
            p += P;
        }
        while p < n_panels {
            panel_group::<R, 1>(x, in_dim, panels, out_dim, y, p);
            p += 1;
        }
    }

    /// How far ahead (in `k`) the weights are prefetched: 128 steps of a panel, 4 KiB
    /// (batch 8 on the 2026-11-22 AMD host: 1.3x the decode throughput without it; 32,
    /// 64, 256 and 512 steps ahead did less well).
    const PREFETCH_K: usize = 128;

    #[inline(always)]
    unsafe fn panel_group<const R: usize, const P: usize>(
        x: *const f32,
        in_dim: usize,
        panels: &[f32],
        out_dim: usize,
        y: *mut f32,
        first: usize,
    ) {
        let mut acc = [[_mm256_setzero_ps(); P]; R];
        let base = panels.as_ptr().add(first * in_dim * WIDTH);
        for k in 0..in_dim {
            // The weights stream from memory: ask for them a few cache lines ahead (the
            // hint may point past the panel; prefetches never fault).
            if k % 2 == 0 {
                for q in 0..P {
                    _mm_prefetch::<_MM_HINT_T0>(
                        base.wrapping_add((q * in_dim + k + PREFETCH_K) * WIDTH) as *const i8,
                    );
                }
            }
            let mut w = [_mm256_setzero_ps(); P];
            for (q, wq) in w.iter_mut().enumerate() {
                *wq = _mm256_loadu_ps(base.add((q * in_dim + k) * WIDTH));
            }
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let xr = _mm256_broadcast_ss(&*x.add(r * in_dim + k));
                for (a, wq) in acc_r.iter_mut().zip(&w) {
                    *a = _mm256_fmadd_ps(xr, *wq, *a);
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (q, a) in acc_r.iter().enumerate() {
                let col = (first + q) * WIDTH;
                let dst = y.add(r * out_dim + col);
                if col + WIDTH <= out_dim {
                    _mm256_storeu_ps(dst, *a);
                } else {
                    let mut tmp = [0f32; WIDTH];
                    _mm256_storeu_ps(tmp.as_mut_ptr(), *a);
                    std::ptr::copy_nonoverlapping(tmp.as_ptr(), dst, out_dim - col);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel against a plain f64 sum, for widths that are and are not multiples of a
    /// panel, every block size, and more rows than one block.
    #[test]
    fn products_match_a_plain_sum_and_rows_do_not_affect_each_other() {
        if !supported() {
            return;
        }
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        for (out_dim, in_dim) in [(1024, 384), (7, 5), (130, 33), (16, 1), (9, 64)] {
            let w: Vec<f32> = (0..out_dim * in_dim).map(|_| next()).collect();
            let panels = pack(&w, out_dim, in_dim);
            let rows_max = 19;
            let x: Vec<f32> = (0..rows_max * in_dim).map(|_| next()).collect();
            let mut alone = vec![0f32; rows_max * out_dim];
            for r in 0..rows_max {
                unsafe {
                    matmul_t(
                        x[r * in_dim..].as_ptr(),
                        1,
                        in_dim,
                        &panels,
                        out_dim,
                        alone[r * out_dim..].as_mut_ptr(),
                    )
                };
            }
            for rows in 1..=rows_max {
                let mut y = vec![f32::NAN; rows * out_dim];
                unsafe { matmul_t(x.as_ptr(), rows, in_dim, &panels, out_dim, y.as_mut_ptr()) };
                // Bitwise what each row gets alone.
                assert_eq!(
                    y,
                    alone[..rows * out_dim],
                    "{out_dim}x{in_dim}, {rows} rows"
                );
                for r in 0..rows {
                    for o in 0..out_dim {
                        let want: f64 = (0..in_dim)
                            .map(|k| x[r * in_dim + k] as f64 * w[o * in_dim + k] as f64)
                            .sum();
                        let got = y[r * out_dim + o] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * (in_dim as f64).sqrt().max(1.0),
                            "{out_dim}x{in_dim}, {rows} rows, ({r}, {o}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
