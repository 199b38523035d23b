//! Decode-time matmul of a few rows: `y[M, N] = x[M, K] W[K, N] (+ bias)` with `W` packed once into
//! column panels, for the incremental decoding of [`crate::generate`] on the CPU.
//!
//! Why hand-written: a decode step multiplies a handful of rows (the batch) by every weight matrix
//! of the model, so it is bound by reading the weights from memory (SmolLM2-135M: 540 MB per step).
//! burn-flex hands such products to the `gemm` crate, whose micro-kernels vectorise the long
//! dimension and read each `W` column block at a stride of `N` floats per `k`, and split an
//! 8-row batch into a 6-column and a 2-column tile: measured here it streams the weights at
//! ~10 GB/s of the machine's ~17 GB/s. No maintained crate offers a packed small-`M` product
//! (gemv-style crates handle `M = 1` only). Here `W` is stored as panels of [`PANEL`] columns,
//! each panel `[K, PANEL]` contiguous, so a panel is one linear stream that the hardware
//! prefetcher follows; a tile of up to [`MR`] rows keeps its `MR x PANEL` accumulators in
//! registers (AVX-512: 8 x 3 vectors; AVX2, with half the registers of half the width: 2 rows x 6
//! vectors per sweep), every loaded weight vector serves every row, and the further row tiles
//! re-read the panel from cache (AVX-512: the whole panel from L2, `K x 192` bytes: 110 KB for `K`
//! = 576; AVX2: blocks of 96 panel rows from L1), so the weights still cross the memory bus once.
//! Threads split the panels.
//!
//! Packing costs one pass over the weights (done once per [`crate::generate`] call, merged with
//! the LoRA adapters there) and as much memory again as the packed matrices.
//!
//! Numerics: each output is a sequential fused multiply-add over `k` in f32, so results differ
//! from `gemm`'s blocked sums by rounding only (tested against an f64 reference).

use rayon::prelude::*;

/// Columns per panel (three 16-float AVX-512 vectors).
pub const PANEL: usize = 48;
/// Rows per register tile.
pub const MR: usize = 8;

/// One row-major matrix `[K, n]` of a [`PackedMatrix::pack`] call, with an optional bias `[n]`.
#[derive(Debug, Clone, Copy)]
pub struct Part<'a> {
    /// The weights, `[K, n]` row-major.
    pub w: &'a [f32],
    /// Columns.
    pub n: usize,
    /// Bias `[n]`, if any.
    pub bias: Option<&'a [f32]>,
}

/// A `[K, N]` weight matrix in panel layout, with an optional bias `[N]`.
#[derive(Debug, Clone)]
pub struct PackedMatrix {
    k: usize,
    n: usize,
    /// `ceil(N / PANEL)` panels, each `[K, PANEL]` row-major; the last one zero-padded.
    panels: Vec<f32>,
    bias: Option<Vec<f32>>,
}

impl PackedMatrix {
    /// Packs the column-wise concatenation of row-major matrices `parts[i]` `[K, n_i]` (the
    /// fused q/k/v or gate/up projections) with their optional biases (a missing bias is zero
    /// when another part has one).
    ///
    /// # Panics
    /// If a part's length is not `k * n_i`, or a bias's length is not `n_i`.
    pub fn pack(k: usize, parts: &[Part<'_>]) -> Self {
        let n: usize = parts.iter().map(|p| p.n).sum();
        let n_panels = n.div_ceil(PANEL);
        let mut panels = vec![0.0f32; n_panels * k * PANEL];
        // Column `j` of the whole matrix is column `owners[j].1` of part `owners[j].0`.
        let mut owners = Vec::with_capacity(n);
        for (pi, p) in parts.iter().enumerate() {
            let ni = p.n;
            let len = p.w.len();
            assert_eq!(len, k * ni, "part {pi}: {len} values for [{k}, {ni}]");
            if let Some(b) = p.bias {
                let bl = b.len();
                assert_eq!(bl, ni, "part {pi}: bias of {bl} for {ni} columns");
            }
            owners.extend((0..ni).map(|c| (pi, c)));
        }
        panels
            .par_chunks_mut(k * PANEL)
            .enumerate()
            .for_each(|(p, panel)| {
                let cols = &owners[p * PANEL..(p * PANEL + PANEL).min(n)];
                for (kk, dst) in panel.chunks_exact_mut(PANEL).enumerate() {
                    for (d, &(pi, c)) in dst.iter_mut().zip(cols) {
                        *d = parts[pi].w[kk * parts[pi].n + c];
                    }
                }
            });
        let bias = parts.iter().any(|p| p.bias.is_some()).then(|| {
            parts
                .iter()
                .flat_map(|p| match p.bias {
                    Some(b) => b.to_vec(),
                    None => vec![0.0; p.n],
                })
                .collect()
        });
        PackedMatrix { k, n, panels, bias }
    }

    /// Input width `K`.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Output width `N`.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Bytes the packed weights hold.
    pub fn bytes(&self) -> usize {
        (self.panels.len() + self.bias.as_ref().map_or(0, Vec::len)) * 4
    }

    /// `x` `[M, K]` row-major -> `[M, N]` row-major.
    ///
    /// # Panics
    /// If `x.len()` is not a multiple of `K`.
    pub fn matmul(&self, x: &[f32]) -> Vec<f32> {
        let (k, n) = (self.k, self.n);
        assert!(
            k > 0 && x.len().is_multiple_of(k),
            "{} inputs for K = {k}",
            x.len()
        );
        let m = x.len() / k;
        let mut y = vec![0.0f32; m * n];
        if m == 0 || n == 0 {
            return y;
        }
        let n_panels = n.div_ceil(PANEL);
        let out = SyncPtr(y.as_mut_ptr());
        let run = |p0: usize, p1: usize| {
            let mut tile = vec![[0.0f32; PANEL]; m];
            for p in p0..p1 {
                let panel = &self.panels[p * k * PANEL..(p + 1) * k * PANEL];
                let c0 = p * PANEL;
                let width = PANEL.min(n - c0);
                panel_tile(x, k, panel, &mut tile);
                for (row, t) in tile.iter().enumerate() {
                    // SAFETY: row < m and c0 + width <= n, so the range is inside `y`;
                    // panels are split between threads, so no two threads write the same
                    // columns, and `y` outlives the scope below.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(out.get().add(row * n + c0), width)
                    };
                    dst.copy_from_slice(&t[..width]);
                    if let Some(b) = &self.bias {
                        for (d, bv) in dst.iter_mut().zip(&b[c0..c0 + width]) {
                            *d += bv;
                        }
                    }
                }
            }
        };
        let threads = rayon::current_num_threads().min(n_panels);
        // Below ~1 MFLOP a rayon dispatch costs more than it saves.
        if threads <= 1 || m * k * n < (1 << 20) {
            run(0, n_panels);
        } else {
            (0..threads).into_par_iter().for_each(|t| {
                run(n_panels * t / threads, n_panels * (t + 1) / threads);
            });
        }
        y
    }
}

/// A raw output pointer shared by rayon tasks that each write their own elements (the columns of
/// [`PackedMatrix::matmul`], the heads of `fused`'s attention).
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr(pub(crate) *mut f32);
// SAFETY: every use has its tasks write disjoint ranges (see the uses).
unsafe impl Send for SyncPtr {}
// SAFETY: as above.
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// The pointer (a method, so that closures capture the whole `Send` wrapper).
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// `tile[r][j] = sum_kk x[r * k + kk] * panel[kk * PANEL + j]` for all `tile.len()` rows.
fn panel_tile(x: &[f32], k: usize, panel: &[f32], tile: &mut [[f32; PANEL]]) {
    debug_assert!(x.len() == tile.len() * k && panel.len() == k * PANEL);
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        for (r0, t) in (0..tile.len()).step_by(MR).zip(tile.chunks_mut(MR)) {
            let x = &x[r0 * k..(r0 + t.len()) * k];
            macro_rules! tiles {
                ($($r:literal)*) => {
                    match t.len() {
                        $($r => {
                            // SAFETY: the CPU has AVX-512F (checked above); the slices have
                            // the lengths the kernel reads (asserted in debug builds,
                            // guaranteed by the caller).
                            unsafe { avx512::tile::<$r>(x, k, panel, t) }
                        })*
                        _ => unreachable!("tiles have 1..=MR rows"),
                    }
                };
            }
            tiles!(1 2 3 4 5 6 7 8);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked above); lengths as above.
        unsafe { avx2::tile(x, k, panel, tile) };
        return;
    }
    portable(x, k, panel, tile);
}

#[inline(always)]
fn portable(x: &[f32], k: usize, panel: &[f32], tile: &mut [[f32; PANEL]]) {
    for (r, acc) in tile.iter_mut().enumerate() {
        *acc = [0.0; PANEL];
        let xr = &x[r * k..(r + 1) * k];
        for (kk, &xv) in xr.iter().enumerate() {
            let w = &panel[kk * PANEL..(kk + 1) * PANEL];
            for (a, &wv) in acc.iter_mut().zip(w) {
                *a = xv.mul_add(wv, *a);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::PANEL;
    use std::arch::x86_64::*;

    /// Rows of the panel the kernel prefetches ahead of the one it reads (16-32 measured
    /// best; the address may lie past the panel: a prefetch never faults).
    const PREFETCH: usize = 24;

    /// `R` rows x [`PANEL`] columns, accumulators in 3R registers.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; `x.len() >= R * k`, `panel.len() >= k * PANEL`,
    /// `tile.len() == R`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile<const R: usize>(
        x: &[f32],
        k: usize,
        panel: &[f32],
        tile: &mut [[f32; PANEL]],
    ) {
        let mut acc = [[_mm512_setzero_ps(); 3]; R];
        let xp = x.as_ptr();
        let mut wp = panel.as_ptr();
        for kk in 0..k {
            // SAFETY: kk < k, so the three vectors are inside the panel's row kk and the
            // broadcasts inside x's rows (lengths per the contract).
            unsafe {
                // The panel's rows PREFETCH ahead, all three cache lines of a row: measured
                // 1.4x faster than the hardware prefetcher alone on a 540 MB model.
                let ahead = wp.wrapping_add(PREFETCH * PANEL) as *const i8;
                _mm_prefetch::<_MM_HINT_T0>(ahead);
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64));
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(128));
                let w0 = _mm512_loadu_ps(wp);
                let w1 = _mm512_loadu_ps(wp.add(16));
                let w2 = _mm512_loadu_ps(wp.add(32));
                for (r, a) in acc.iter_mut().enumerate() {
                    let b = _mm512_set1_ps(*xp.add(r * k + kk));
                    a[0] = _mm512_fmadd_ps(b, w0, a[0]);
                    a[1] = _mm512_fmadd_ps(b, w1, a[1]);
                    a[2] = _mm512_fmadd_ps(b, w2, a[2]);
                }
                wp = wp.add(PANEL);
            }
        }
        for (t, a) in tile.iter_mut().zip(&acc) {
            // SAFETY: each tile row holds PANEL = 48 floats.
            unsafe {
                _mm512_storeu_ps(t.as_mut_ptr(), a[0]);
                _mm512_storeu_ps(t.as_mut_ptr().add(16), a[1]);
                _mm512_storeu_ps(t.as_mut_ptr().add(32), a[2]);
            }
        }
    }
}

/// The AVX2 + FMA kernel (AMD Zen 2/3, Intel Haswell to Alder Lake): 16 vector registers of 8
/// floats hold a tile of at most 2 rows x [`PANEL`] columns (12 accumulators, 2 broadcasts, one
/// weight vector at a time), so each block of the panel is swept once per 2 rows. The first sweep
/// streams the block from memory (with software prefetch, as the AVX-512 kernel); the others find
/// it in L1 (18 KB). Measured on a Zen 3 (2 cores, SmolLM2-135M shapes, `bench_skinny`), ms per
/// step at 1 / 8 / 32 rows: 25.0 / 31.8 / 70.4 with whole-panel sweeps from L2 (burn-flex's gemm in
/// the same run: 28.8 / 73.5 / 129); the auto-vectorised portable loop, which keeps its accumulators
/// in memory, measured 29 / 88 / 298, and a 4-row x 24-column tile swept twice per panel 43 / 53 /
/// 126 (the split panel rows defeat the streaming). The L1 blocks measured 5-10% faster than the
/// L2 sweeps at 20-32 rows on one thread (old and new run side by side, 3 alternations).
/// The sweeps after a block's first one prefetch the next block into L2, spread over their
/// iterations, so that the memory stream overlaps the arithmetic instead of stalling the first
/// sweep: 8 rows, one thread, old and new run at once on the two cores (6 pairs, cores swapped
/// half way): 61-76 ms vs 71-96 ms per step (~17% less); 32 rows within the machine's noise.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::PANEL;
    use std::arch::x86_64::*;

    /// Rows of the panel prefetched ahead of the one read (as the AVX-512 kernel).
    const PREFETCH: usize = 24;
    /// Vectors per panel row.
    const VECS: usize = PANEL / 8;

    /// Panel rows per block: a block (`KB x PANEL` floats, 18 KB) stays in the 32 KB L1 while
    /// every 2-row sweep of the tile reads it.
    const KB: usize = 96;

    /// `tile.len()` rows x [`PANEL`] columns: per block of [`KB`] panel rows, one 2-row sweep
    /// after the other (the first one streams the block from memory, the others find it in L1).
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; `x.len() >= tile.len() * k`, `panel.len() >= k * PANEL`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile(x: &[f32], k: usize, panel: &[f32], tile: &mut [[f32; PANEL]]) {
        let m = tile.len();
        debug_assert!(x.len() >= m * k && panel.len() >= k * PANEL);
        // The sweeps after the first spread prefetches (into L2) of the next block's cache lines
        // over their iterations, so that the next first sweep finds its block in L2 instead of
        // waiting on memory: the memory stream overlaps the arithmetic.
        let later_sweeps = m.div_ceil(2).saturating_sub(1);
        let block_lines = KB * PANEL * 4 / 64;
        let lines = block_lines.div_ceil(later_sweeps.max(1));
        for k0 in (0..k).step_by(KB) {
            let kl = KB.min(k - k0);
            let w = &panel[k0 * PANEL..(k0 + kl) * PANEL];
            // The next block of this panel, or the start of the next panel (panels are
            // contiguous); past the last panel the addresses are only prefetched, never read.
            let mut next = panel.as_ptr().wrapping_add((k0 + kl) * PANEL) as *const i8;
            let pf = Prefetch::new(lines, kl);
            let mut r0 = 0;
            while r0 < m {
                let rows = (m - r0).min(2);
                let xs = &x[r0 * k + k0..];
                let t = &mut tile[r0..r0 + rows];
                // SAFETY: as this function's contract: row r of `xs` starts at r * k and holds
                // kl inputs (r0 + r < m, k0 + kl <= k); `w` holds kl panel rows. Prefetch only
                // on the sweep that streams the block from memory; accumulate onto the tile
                // after the first block.
                unsafe {
                    match (rows, r0 == 0, k0 > 0) {
                        (1, true, false) => sweep::<1, true, false>(xs, k, kl, w, t, pf, next),
                        (1, true, true) => sweep::<1, true, true>(xs, k, kl, w, t, pf, next),
                        (1, false, false) => sweep::<1, false, false>(xs, k, kl, w, t, pf, next),
                        (1, false, true) => sweep::<1, false, true>(xs, k, kl, w, t, pf, next),
                        (_, true, false) => sweep::<2, true, false>(xs, k, kl, w, t, pf, next),
                        (_, true, true) => sweep::<2, true, true>(xs, k, kl, w, t, pf, next),
                        (_, false, false) => sweep::<2, false, false>(xs, k, kl, w, t, pf, next),
                        (_, false, true) => sweep::<2, false, true>(xs, k, kl, w, t, pf, next),
                    }
                }
                if r0 > 0 {
                    next = next.wrapping_add(64 * lines);
                }
                r0 += rows;
            }
        }
    }

    /// How a later sweep spreads its share of the next block's lines over its `kl` iterations:
    /// `per` lines every `every` iterations.
    #[derive(Clone, Copy)]
    struct Prefetch {
        every: usize,
        per: usize,
    }

    impl Prefetch {
        fn new(lines: usize, kl: usize) -> Self {
            let per = lines.div_ceil(kl.max(1)).max(1);
            let every = (kl * per / lines.max(1)).max(1);
            Prefetch { every, per }
        }
    }

    /// `R` rows x [`PANEL`] columns over `kl` panel rows, accumulators in 6R registers: row `r`
    /// of the tile gets (`ACC`: plus) `sum_kk x[r * stride + kk] * w[kk * PANEL ..]`.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; `x.len() >= (R - 1) * stride + kl`,
    /// `w.len() >= kl * PANEL`, `tile.len() == R`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn sweep<const R: usize, const FETCH: bool, const ACC: bool>(
        x: &[f32],
        stride: usize,
        kl: usize,
        w: &[f32],
        tile: &mut [[f32; PANEL]],
        pf: Prefetch,
        mut next: *const i8,
    ) {
        debug_assert!(x.len() >= (R - 1) * stride + kl && w.len() >= kl * PANEL);
        debug_assert!(tile.len() == R);
        let mut acc = [[_mm256_setzero_ps(); VECS]; R];
        if ACC {
            for (a, t) in acc.iter_mut().zip(tile.iter()) {
                for (j, v) in a.iter_mut().enumerate() {
                    // SAFETY: j < VECS, so the 8 floats lie in the tile row's PANEL.
                    *v = unsafe { _mm256_loadu_ps(t.as_ptr().add(8 * j)) };
                }
            }
        }
        let xp = x.as_ptr();
        let mut wp = w.as_ptr();
        let mut countdown = 1;
        for kk in 0..kl {
            // SAFETY: kk < kl, so the six vectors lie in the block's row kk and the broadcasts
            // in x's rows (lengths per the contract).
            unsafe {
                if FETCH {
                    // The panel row PREFETCH ahead, all three cache lines (the address may lie
                    // past the panel: a prefetch never faults).
                    let ahead = wp.wrapping_add(PREFETCH * PANEL) as *const i8;
                    _mm_prefetch::<_MM_HINT_T0>(ahead);
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64));
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(128));
                } else {
                    countdown -= 1;
                    if countdown == 0 {
                        countdown = pf.every;
                        for _ in 0..pf.per {
                            _mm_prefetch::<_MM_HINT_T1>(next);
                            next = next.wrapping_add(64);
                        }
                    }
                }
                let mut b = [_mm256_setzero_ps(); R];
                for (r, bv) in b.iter_mut().enumerate() {
                    *bv = _mm256_broadcast_ss(&*xp.add(r * stride + kk));
                }
                for j in 0..VECS {
                    let w = _mm256_loadu_ps(wp.add(8 * j));
                    for (a, bv) in acc.iter_mut().zip(&b) {
                        a[j] = _mm256_fmadd_ps(*bv, w, a[j]);
                    }
                }
                wp = wp.add(PANEL);
            }
        }
        for (t, a) in tile.iter_mut().zip(&acc) {
            for (j, v) in a.iter().enumerate() {
                // SAFETY: j < VECS, so the 8 floats lie in the tile row's PANEL.
                unsafe { _mm256_storeu_ps(t.as_mut_ptr().add(8 * j), *v) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Owned weights of one part: `[K, n]`, n, bias.
    type Owned = (Vec<f32>, usize, Option<Vec<f32>>);

    fn reference(x: &[f32], m: usize, k: usize, parts: &[Owned]) -> Vec<f64> {
        let n: usize = parts.iter().map(|p| p.1).sum();
        let mut y = vec![0.0f64; m * n];
        for r in 0..m {
            let mut c0 = 0;
            for (w, ni, b) in parts {
                for c in 0..*ni {
                    let mut s = b.as_ref().map_or(0.0, |b| b[c] as f64);
                    for kk in 0..k {
                        s += x[r * k + kk] as f64 * w[kk * ni + c] as f64;
                    }
                    y[r * n + c0 + c] = s;
                }
                c0 += ni;
            }
        }
        y
    }

    fn check(m: usize, k: usize, widths: &[(usize, bool)], seed: u64) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut v = |len: usize| {
            (0..len)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect::<Vec<_>>()
        };
        let x = v(m * k);
        let parts: Vec<Owned> = widths
            .iter()
            .map(|&(ni, bias)| (v(k * ni), ni, bias.then(|| v(ni))))
            .collect();
        let refs: Vec<Part<'_>> = parts
            .iter()
            .map(|(w, n, b)| Part {
                w,
                n: *n,
                bias: b.as_deref(),
            })
            .collect();
        let packed = PackedMatrix::pack(k, &refs);
        let y = packed.matmul(&x);
        let want = reference(&x, m, k, &parts);
        assert_eq!(y.len(), want.len());
        for (i, (a, b)) in y.iter().zip(&want).enumerate() {
            let tol = 1e-5 * (k as f64).sqrt() * (1.0 + b.abs());
            assert!(
                (*a as f64 - b).abs() <= tol,
                "m={m} k={k} widths={widths:?}: y[{i}] = {a} vs {b}"
            );
        }
    }

    #[test]
    fn matches_an_f64_reference_for_every_tile_height_and_ragged_panels() {
        // Every row-tile height 1..=8, rows past one tile (9, 20), a width that is not a
        // multiple of the panel (ragged last panel), fused parts with and without bias.
        for m in [1, 2, 3, 4, 5, 6, 7, 8, 9, 20] {
            check(m, 37, &[(100, false)], m as u64);
        }
        check(3, 64, &[(48, true), (16, false), (16, true)], 11);
        check(20, 576, &[(576, false), (192, true), (192, false)], 12);
        // Large enough to run on several threads.
        check(8, 256, &[(1000, false), (1000, false)], 13);
    }

    #[test]
    fn portable_kernel_matches_the_dispatched_one() {
        let (m, k) = (5, 33);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let panel: Vec<f32> = (0..k * PANEL)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let mut a = vec![[0.0f32; PANEL]; m];
        let mut b = vec![[0.0f32; PANEL]; m];
        panel_tile(&x, k, &panel, &mut a);
        portable(&x, k, &panel, &mut b);
        for (ra, rb) in a.iter().zip(&b) {
            for (va, vb) in ra.iter().zip(rb) {
                assert!((va - vb).abs() <= 1e-5, "{va} vs {vb}");
            }
        }
    }
}
