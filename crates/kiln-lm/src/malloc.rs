//! The process's memory allocator, set for tensor workloads: freed memory is kept for reuse instead of
//! being handed back to the kernel.
//!
//! Why: burn-flex allocates every op's output afresh, and a training step of SmolLM2 on ~1,000-token rows
//! makes many tensors of tens to hundreds of MB (attention scores `[B, heads, T, T]`, logits). glibc serves
//! any block above its mmap threshold (at most 32 MiB) with a fresh `mmap` and `munmap`s it on free, so every
//! such tensor costs one page fault and one kernel page clear per 4 KiB, every step; and it trims the top of
//! its heap back to the kernel whenever more than the trim threshold is free there. Profiled (`perf`) on a
//! LoRA forward + backward of 2 x 1,042 tokens, the kernel's `clear_page` alone was ~30% of the time.
//! [`keep_freed_memory`] turns both off (`M_MMAP_MAX = 0`, `M_TRIM_THRESHOLD = -1`): big blocks come from
//! the heap and are reused by later steps. Measured (`bench_side`, 2 threads, `KILN_MALLOC=system` vs
//! default, back to back): the LoRA update of 2 x 1,042 tokens (second of two) 40.3 / 38.5 s -> 21.6 / 19.4 s,
//! peak RSS +3%; the 4 x 256 train step, full 9.5 -> 8.5 s (peak RSS +17%, 3.7 -> 4.4 GB), LoRA 9.2 -> 7.7 s
//! (+5%); generation unchanged. The process keeps its high-water mark instead of returning memory between
//! steps, and fragmentation costs some of it; [`release_freed_memory`] hands it back where a phase ends
//! (the search pipeline calls it between training and the final table).
//!
//! A hand-written call rather than a crate: the two `mallopt` settings are the whole change (a replacement
//! allocator such as jemalloc, tried with its decay and oversize arena turned off, was slower and used ~10%
//! more memory here). Only glibc targets are affected; elsewhere it does nothing.

/// Environment variable that keeps the C library's default allocator behaviour (`KILN_MALLOC=system`), e.g.
/// to return memory to the OS between steps on a machine shared with other jobs.
pub const ENV: &str = "KILN_MALLOC";

/// Sets glibc's allocator to keep freed memory (see the module docs). Call once, first thing in `main`,
/// before threads start. Returns whether the setting was applied: `false` off glibc or with
/// `KILN_MALLOC=system`.
pub fn keep_freed_memory() -> bool {
    if std::env::var(ENV).is_ok_and(|v| v == "system") {
        return false;
    }
    apply()
}

/// Hands the free memory the allocator kept back to the kernel (glibc `malloc_trim(0)`: free pages
/// anywhere in the heaps, not only at their top), e.g. between training and a long evaluation, so that
/// the process does not hold its training peak while it evaluates. Returns whether anything was released
/// (`false` off glibc).
pub fn release_freed_memory() -> bool {
    trim()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim() -> bool {
    // SAFETY: malloc_trim only returns free pages of the allocator's heaps to the kernel.
    unsafe { libc::malloc_trim(0) == 1 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() -> bool {
    false
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn apply() -> bool {
    // SAFETY: mallopt only changes the allocator's parameters; both values are documented ones
    // (`M_MMAP_MAX = 0` disables mmap'd chunks, `M_TRIM_THRESHOLD = -1` disables trimming).
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0) == 1 && libc::mallopt(libc::M_TRIM_THRESHOLD, -1) == 1
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn apply() -> bool {
    false
}
